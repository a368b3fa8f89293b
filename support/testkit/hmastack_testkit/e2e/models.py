"""Tiny hybrid models, generated locally with transformers (seeded, no download).

Each model is a ``save_pretrained`` directory with random float32 weights drawn
with a fixed seed, and a byte-level tokenizer (for ``vllm serve``; the engine runs
elsewhere take ``prompt_token_ids``). The default initialisation (std 0.02) gives
near-uniform logits, and greedy output repeats one token whatever the context;
``initializer_range=0.2`` with untied embeddings (Gemma 3: 0.1, tied, as vLLM
requires, and ``query_pre_attn_scalar=2``) make it depend on the context
(:func:`check_context_dependence` is the witness: on gemma-5to1 a change of the
tokens 128+ positions back moves the last logprobs by ~1.2 and 16 greedy tokens
hold 13 distinct ids; with init 0.3 greedy repeats one token).

=============  ==================================  ==============================
name           layers (attention type per layer)   KV cache groups with HMA on
=============  ==================================  ==============================
gemma-5to1     5 sliding (W=32) + 1 full            6 (5 sliding window, 1 full)
gemma-1to1     sliding/full alternating, 6 layers   2 (3 layers each)
mistral-swa    4 sliding (W=32)                     1 (sliding window)
llama4-chunk   3 chunked local (chunk 32) + 1 full  see :data:`MODELS`
bamba-like     3 Mamba-2 + 1 full (layer 1)         2 (1 full attention, 1 Mamba)
=============  ==================================  ==============================

The Mamba hybrid (Bamba-like) runs its Mamba layers with the reference kernels
of :mod:`hmastack_testkit.mamba_reference_kernels` (the CPU platform has no
Triton). Its attention block and ``mamba_block_size`` are 64 tokens, which vLLM
0.13.0 sets for it (the Mamba state of a layer, 9.9 KiB, needs the KV of 40
tokens, rounded up to a multiple of its chunk of 32): a larger block than
``BLOCK_SIZE``.

Usage: ``python -m hmastack_testkit.e2e.models OUT_DIR [NAME ...]``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
VOCAB = 512
BLOCK_SIZE = 16
WINDOW = 32  # tokens: sliding window and local chunk of every model here


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    description: str
    num_layers: int
    sliding_layers: int  # how many layers are sliding window / chunked local
    layers_per_group: int  # layers in one KV cache group with HMA on

    def num_blocks(self, pool_layer_blocks: int, hma: bool) -> int:
        """The KV cache pool size (``num_gpu_blocks_override``) that holds
        ``pool_layer_blocks`` blocks of one layer: with HMA off a block holds
        every layer, with HMA on one layer per layer of a group."""
        return pool_layer_blocks // (self.layers_per_group if hma else self.num_layers)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "gemma-5to1",
            "Gemma3ForCausalLM",
            "Gemma-3-like: 5 sliding-window layers (W=32) then 1 full-attention layer",
            6,
            5,
            1,
        ),
        ModelSpec(
            "gemma-1to1",
            "Gemma3ForCausalLM",
            "sliding window (W=32) and full attention alternating, 6 layers",
            6,
            3,
            3,
        ),
        ModelSpec(
            "mistral-swa",
            "MistralForCausalLM",
            "Mistral-like: every layer sliding window (W=32), one KV cache group",
            4,
            4,
            4,
        ),
        ModelSpec(
            "bamba-like",
            "BambaForCausalLM",
            "Bamba-like: 3 Mamba-2 layers and 1 full-attention layer (layer 1)",
            4,
            0,
            1,
        ),
        ModelSpec(
            "llama4-chunk",
            "Llama4ForCausalLM",
            "Llama-4-like: 3 chunked-local layers (chunk 32) and 1 full layer (NoPE)",
            4,
            3,
            1,
        ),
    )
}


def _config(spec: ModelSpec):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=0.2,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if spec.architecture == "Gemma3ForCausalLM":
        from transformers import Gemma3TextConfig

        if spec.name == "gemma-5to1":
            types = ["sliding_attention"] * 5 + ["full_attention"]
        else:
            types = ["sliding_attention", "full_attention"] * (spec.num_layers // 2)
        # vLLM's Gemma 3 requires tied embeddings: a smaller init then.
        common.update(initializer_range=0.1, tie_word_embeddings=True)
        return Gemma3TextConfig(
            **common,
            sliding_window=WINDOW,
            layer_types=types,
            query_pre_attn_scalar=2,
            rope_theta=10000.0,
            rope_local_base_freq=10000.0,
        )
    if spec.architecture == "BambaForCausalLM":
        from transformers import BambaConfig

        for key in ("num_key_value_heads", "head_dim"):
            common.pop(key)
        return BambaConfig(
            **common,
            num_key_value_heads=1,
            attn_layer_indices=[1],
            # vLLM's Bamba rotates attn_rotary_emb dimensions of each head;
            # transformers' half of them (partial_rotary_factor 0.5).
            attn_rotary_emb=16,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=32,
        )
    if spec.architecture == "MistralForCausalLM":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=WINDOW, rope_theta=10000.0)
    if spec.architecture == "Llama4ForCausalLM":
        from transformers import Llama4TextConfig

        common.pop("intermediate_size")
        return Llama4TextConfig(
            **common,
            intermediate_size=128,
            intermediate_size_mlp=128,
            num_local_experts=1,
            num_experts_per_tok=1,
            interleave_moe_layer_step=0,
            moe_layers=[],
            attention_chunk_size=WINDOW,
            # layer i uses RoPE and chunked local attention when no_rope_layers[i]
            # is 1; the last layer is NoPE with full attention.
            no_rope_layers=[1] * (spec.num_layers - 1) + [0],
            use_qk_norm=False,
            attn_temperature_tuning=False,
            rope_theta=10000.0,
            rope_scaling=None,
        )
    raise ValueError(f"unknown architecture {spec.architecture}")


def write_model(name: str, dest: Path) -> Path:
    """Write model ``name`` (seeded random weights) and a tokenizer to ``dest``.

    Raises ``KeyError`` for an unknown name.
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = MODELS[name]
    config = _config(spec)
    config.architectures = [spec.architecture]
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    _write_tokenizer(dest)
    return dest


def _write_tokenizer(dest: Path) -> None:
    """A byte-level tokenizer: ``<unk> <s> </s>`` and the 256 byte tokens, no
    merges (259 ids, below the model's vocabulary of 512)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(dest / "tokenizer.json"))
    special_map = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1_000_000,
                "clean_up_tokenization_spaces": False,
                **special_map,
            }
        )
    )
    (dest / "special_tokens_map.json").write_text(json.dumps(special_map))


def check_context_dependence(model_dir: Path, tail: int = 4 * WINDOW) -> dict:
    """Witness that greedy output depends on the context beyond the window.

    Two prompts that share their last ``tail`` tokens and differ before (beyond
    any sliding window; for an all-sliding-window model ``tail`` must stay
    inside the stacked layers' reach, num_layers * (W - 1)) must give different
    next-token distributions, and greedy decoding of one prompt must not repeat
    a single token. Returns the measured figures.
    """
    far = 3 * WINDOW
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    tail = torch.randint(3, VOCAB, (1, tail), generator=g)
    a = torch.cat([torch.randint(3, VOCAB, (1, far), generator=g), tail], dim=1)
    b = torch.cat([torch.randint(3, VOCAB, (1, far), generator=g), tail], dim=1)
    with torch.no_grad():
        la = model(a).logits[0, -1].log_softmax(-1)
        lb = model(b).logits[0, -1].log_softmax(-1)
        out = model.generate(a, max_new_tokens=16, do_sample=False)
    generated = out[0, a.shape[1] :].tolist()
    return {
        "max_logprob_change_from_far_context": float((la - lb).abs().max()),
        "distinct_greedy_tokens": len(set(generated)),
        "top1_logprob": float(la.max()),
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    names = argv[1:] or list(MODELS)
    for name in names:
        write_model(name, out / name)
        tail = (
            WINDOW + 8
            if MODELS[name].sliding_layers == MODELS[name].num_layers
            else 4 * WINDOW
        )
        print(name, json.dumps(check_context_dependence(out / name, tail)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
