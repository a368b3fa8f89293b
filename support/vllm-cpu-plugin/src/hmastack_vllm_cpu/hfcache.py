"""Write an offline Hugging Face hub cache: config files and a tiny tokenizer.

vLLM's unit tests name hub models (``facebook/opt-125m``, ...) only to build a
``ModelConfig``; no weights are read. With ``HF_HUB_OFFLINE=1`` and ``HF_HOME``
pointing at the directory written here, ``transformers`` and ``huggingface_hub``
resolve those ids from the cache.

Layout written per model id ``org/name`` (the hub cache layout)::

    <hf_home>/hub/models--org--name/refs/main            -> <revision>
    <hf_home>/hub/models--org--name/snapshots/<revision>/config.json
                                                         tokenizer.json
                                                         tokenizer_config.json
                                                         special_tokens_map.json
                                                         <extra files>

The revision is derived from the model's entry, so the cache is byte-for-byte
reproducible. The tokenizer is byte-level BPE with no merges: 256 byte tokens
plus the special tokens, enough to encode any text.

A model entry is ``{"config": {...}, "files": {name: json}, "tokenizer": {...}}``
where ``tokenizer`` may hold ``extra_special_tokens`` (a list; dense ids after
``<unk> <s> </s>``) and ``special_token_ids`` (``{token: id}``; special tokens
at fixed, possibly sparse ids, e.g. an image placeholder whose id the model
config names). ``files`` are written last and replace generated files.

Usage: ``python -m hmastack_vllm_cpu.hfcache MODELS_JSON HF_HOME``
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _tokenizer_files(
    extra_special: list[str], pinned: dict[str, int] | None = None
) -> dict[str, object]:
    """Tokenizer files: a byte-level vocab plus special tokens.

    ``extra_special`` tokens get the next dense ids after ``<unk> <s> </s>``
    and before the 256 byte tokens. ``pinned`` maps further special tokens to
    fixed ids (e.g. ``{"<image>": 32000}`` where a model config names that id);
    the vocab stays sparse, so no padding tokens are written for the gap.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pinned = dict(pinned or {})
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = SPECIAL_TOKENS + [
        t for t in extra_special if t not in SPECIAL_TOKENS and t not in pinned
    ]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab.setdefault(ch, len(vocab))
    dense_size = len(vocab)
    for tok, tok_id in pinned.items():
        if tok in vocab:
            raise ValueError(f"pinned token {tok!r} is already in the base vocab")
        if not isinstance(tok_id, int) or tok_id < dense_size:
            raise ValueError(
                f"pinned id {tok_id!r} of {tok!r} collides with the dense ids "
                f"0..{dense_size - 1}"
            )
    if len(set(pinned.values())) != len(pinned):
        raise ValueError(f"pinned special-token ids are not unique: {pinned}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer_json = json.loads(tokenizer.to_str())
    # `tokenizers` keeps an added token's id only if the model vocab holds the
    # token (other added tokens are renumbered densely on load), so a pinned
    # token goes into the BPE vocab and into added_tokens at its id. It is
    # spliced into the serialized form: serializing a vocab with holes makes
    # `tokenizers` print every missing id to stdout. Loading it is silent;
    # the print recurs only where a consumer re-serializes the tokenizer (e.g.
    # transformers' ProcessorMixin.__repr__ deep-copies it once per load).
    template = tokenizer_json["added_tokens"][0]
    for tok, tok_id in sorted(pinned.items(), key=lambda kv: kv[1]):
        tokenizer_json["model"]["vocab"][tok] = tok_id
        tokenizer_json["added_tokens"].append(
            {**template, "id": tok_id, "content": tok}
        )
    special_map = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1_000_000,
            "clean_up_tokenization_spaces": False,
            **special_map,
        },
        "special_tokens_map.json": special_map,
    }


def write_cache(models: dict[str, dict], hf_home: Path) -> list[str]:
    """Write every model of ``models`` under ``hf_home``; returns the model ids."""
    written = []
    for model_id, entry in sorted(models.items()):
        if model_id.startswith("_"):
            continue
        files: dict[str, object] = {"config.json": entry["config"]}
        tok_spec = entry.get("tokenizer", {})
        files.update(
            _tokenizer_files(
                tok_spec.get("extra_special_tokens", []),
                tok_spec.get("special_token_ids", {}),
            )
        )
        files.update(entry.get("files", {}))
        blob = json.dumps(files, sort_keys=True).encode()
        revision = hashlib.sha1(blob).hexdigest()
        repo = hf_home / "hub" / ("models--" + model_id.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (snapshot / name).write_text(json.dumps(content, indent=2, sort_keys=True))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        written.append(model_id)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    models = json.loads(Path(argv[0]).read_text())
    written = write_cache(models, Path(argv[1]))
    print(f"wrote {len(written)} models to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
