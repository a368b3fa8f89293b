"""Scenario 3: scheduler CPU time per step (schedule() + update_from_output()).

A scheduler built on the CPU with vLLM's own test helper
(``tests/v1/core/utils.py: create_scheduler/create_requests`` of this tree), fed a
fake model runner output (one sampled token per request that finished its
prefill). ``time.process_time`` around the two calls; the result is the mean CPU
milliseconds per step over ``steps`` steps. The orchestrator alternates trees
(one process per run) and forms ratios; timings never fail anything.
"""

from __future__ import annotations

import time

import _common as c


def run(num_requests: int, mode: str, steps: int) -> float:
    from tests.v1.core.utils import create_requests, create_scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    if mode == "decode":
        prompt, batched, warmup = 64, max(8192, num_requests * 64), 2
    else:  # prefill-heavy: long prompts, chunked prefill, every step is prefill
        prompt, batched, warmup = 2048, 8192, 1
    sched = create_scheduler(
        max_num_seqs=num_requests,
        max_num_batched_tokens=batched,
        max_model_len=prompt + 4096,
        enable_prefix_caching=True,
        num_blocks=num_requests * (prompt + 4096) // 16 + 16,
    )
    for req in create_requests(num_requests, num_tokens=prompt, max_tokens=4096):
        sched.add_request(req)

    def one_step() -> float:
        t0 = time.process_time()
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = sched.requests[rid]
            sampled.append([0] if r.num_computed_tokens >= r.num_prompt_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        sched.update_from_output(out, mro)
        return time.process_time() - t0

    for _ in range(warmup):
        one_step()
    total = sum(one_step() for _ in range(steps))
    return 1000.0 * total / steps


def main() -> None:
    a = c.args()
    steps = int(a.get("steps", 20))
    rows = []
    for mode in a.get("modes", ["decode", "prefill"]):
        for n in a.get("sizes", [64, 256]):
            rows.append(
                {"mode": mode, "requests": n, "cpu_ms_per_step": run(n, mode, steps)}
            )
    c.emit({"steps": steps, "rows": rows, **c.tree_info()})


if __name__ == "__main__":
    main()
