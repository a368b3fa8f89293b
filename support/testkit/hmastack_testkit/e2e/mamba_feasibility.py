"""Does vLLM's CPU engine run a Mamba hybrid? One run of the check.

The model is the Bamba-like tiny model (:mod:`hmastack_testkit.e2e.models`,
``bamba-like``); its Mamba layers run the reference kernels of
:mod:`hmastack_testkit.mamba_reference_kernels` (fakes at the Triton
boundary). One mode per process (vLLM: one engine per process):

- ``hf``: transformers' own forward of the same weights (its plain-torch Mamba
  path): greedy tokens of each prompt, and the log-probabilities of the first
  prompt's tokens;
- ``nopc``: vLLM without prefix caching: greedy tokens, top-1 logprobs, and
  the prompt log-probabilities of the first prompt;
- ``pc``: vLLM with prefix caching (Mamba prefix caching: 64-token blocks,
  one state per block): the prompts in order, so that the later ones hit the
  states the earlier ones left (``num_cached_tokens``).

Usage: ``python -m hmastack_testkit.e2e.mamba_feasibility MODEL_DIR MODE OUT``
and ``python -m hmastack_testkit.e2e.mamba_feasibility compare HF NOPC PC``
(prints each prompt's verdict; exit status 1 if any differs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_TOKENS = 16
# Prompt logprobs of the first prompt: positions compared with transformers.
PROMPT_LOGPROB_TOKENS = 100
# top-1 logprobs of the two vLLM runs and transformers' prompt logprobs: the
# same computation in another order (float32).
TOLERANCE = 1e-4


def prompts() -> dict[str, list[int]]:
    """A (200 tokens), A again, B (A's first 150 tokens and 60 others), C
    (A's first 130 tokens): with prefix caching A again hits 192 tokens (the
    state after block 2), B and C 128 (after block 1)."""
    import torch

    g = torch.Generator().manual_seed(7)
    a = torch.randint(3, 512, (200,), generator=g).tolist()
    b = a[:150] + torch.randint(3, 512, (60,), generator=g).tolist()
    return {"A": a, "A-again": a, "B": b, "C": a[:130]}


def run_hf(model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out: dict = {"requests": {}}
    for key, tokens in prompts().items():
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([tokens]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        out["requests"][key] = {"tokens": generated[0, len(tokens) :].tolist()}
    a = prompts()["A"][:PROMPT_LOGPROB_TOKENS]
    with torch.no_grad():
        logprobs = model(torch.tensor([a])).logits[0].log_softmax(-1)
    out["prompt_logprobs"] = [
        float(logprobs[pos - 1, a[pos]]) for pos in range(1, len(a))
    ]
    return out


def run_vllm(model_dir: Path, prefix_caching: bool) -> dict:
    from vllm import LLM, SamplingParams

    from hmastack_testkit import mamba_reference_kernels

    mamba_reference_kernels.install()
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=prefix_caching,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    out: dict = {
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "requests": {},
    }
    sampling = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1
    )
    for key, tokens in prompts().items():
        (result,) = llm.generate(
            [{"prompt_token_ids": tokens}], sampling, use_tqdm=False
        )
        completion = result.outputs[0]
        out["requests"][key] = {
            "tokens": list(completion.token_ids),
            "num_cached_tokens": result.num_cached_tokens,
            "logprobs": [
                max(pos.values(), key=lambda lp: lp.logprob).logprob
                for pos in completion.logprobs
            ],
        }
    if not prefix_caching:
        a = prompts()["A"][:PROMPT_LOGPROB_TOKENS]
        (result,) = llm.generate(
            [{"prompt_token_ids": a}],
            SamplingParams(max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )
        out["prompt_logprobs"] = [
            result.prompt_logprobs[pos][a[pos]].logprob for pos in range(1, len(a))
        ]
    return out


def compare(hf: dict, nopc: dict, pc: dict) -> list[str]:
    """One line per check; a line starting with ``DIFFERS`` is a failure."""
    lines = []
    diff = max(
        abs(x - y)
        for x, y in zip(hf["prompt_logprobs"], nopc["prompt_logprobs"], strict=True)
    )
    ok = diff <= TOLERANCE
    verdict = "equal" if ok else "DIFFERS"
    lines.append(
        f"{verdict}: prompt logprobs of {len(hf['prompt_logprobs'])} positions, "
        f"transformers vs vLLM, max |diff| {diff:.1e}"
    )
    for key, ref in hf["requests"].items():
        a, b = nopc["requests"][key], pc["requests"][key]
        lp = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
        ok = ref["tokens"] == a["tokens"] == b["tokens"] and lp <= TOLERANCE
        lines.append(
            f"{'equal' if ok else 'DIFFERS'}: {key}: {len(ref['tokens'])} greedy "
            f"tokens transformers / vLLM / vLLM with prefix caching "
            f"({b['num_cached_tokens']} cached tokens), top-1 logprobs max |diff| "
            f"{lp:.1e}"
        )
    return lines


def main(argv: list[str]) -> int:
    if argv[0] == "compare":
        hf, nopc, pc = (json.loads(Path(p).read_text()) for p in argv[1:4])
        lines = compare(hf, nopc, pc)
        print("\n".join(lines))
        return int(any(line.startswith("DIFFERS") for line in lines))
    model_dir, mode, out = Path(argv[0]), argv[1], Path(argv[2])
    if mode == "hf":
        result = run_hf(model_dir)
    elif mode in ("nopc", "pc"):
        result = run_vllm(model_dir, prefix_caching=mode == "pc")
    else:
        raise SystemExit(f"unknown mode {mode!r}: hf, nopc or pc")
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
