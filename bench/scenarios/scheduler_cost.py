"""Scenario 3: scheduler CPU time per step (schedule() + update_from_output()).

A scheduler built on the CPU with vLLM's own test helper
(``tests/v1/core/utils.py: create_scheduler/create_requests`` of this tree), fed a
fake model runner output (one sampled token per request that finished its
prefill). ``time.process_time`` around the two calls; the result is the mean CPU
milliseconds per step over ``steps`` steps. The orchestrator alternates trees
(one process per run) and forms ratios; timings never fail anything.

Two connector settings, measured in the same process one after the other:

* ``none``: no KV connector (``kv_transfer_config`` unset);
* ``connector``: the scripted ``BenchConnector`` (``_bench_connector.py``), which
  reports the first ``hit_fraction`` of every prompt (rounded down to whole
  blocks) as an external hit loaded synchronously. The same file runs on every
  tree; ``create_scheduler`` builds its ``KVTransferConfig`` from the helper's
  own name, which is pointed at ours for the one call.

Besides the timing, every row records the work done (tokens scheduled, requests
finished, connector calls), the same on every tree when the trees schedule alike.
"""

from __future__ import annotations

import time

import _bench_connector as conn
import _common as c

BLOCK = 16


def make_scheduler(hit_tokens: int | None, **kwargs):
    """``create_scheduler`` of this tree, with the scripted connector when
    ``hit_tokens`` is not None."""
    from tests.v1.core import utils

    if hit_tokens is None:
        return utils.create_scheduler(**kwargs)
    real = utils.KVTransferConfig

    def ours(**_ignored):
        return real(
            kv_connector=conn.NAME,
            kv_connector_module_path=conn.MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={"hit_tokens": hit_tokens},
        )

    utils.KVTransferConfig = ours
    try:
        sched = utils.create_scheduler(use_kv_connector=True, **kwargs)
    finally:
        utils.KVTransferConfig = real
    assert type(sched.connector).__name__ == conn.NAME, type(sched.connector)
    return sched


def run(
    num_requests: int, mode: str, steps: int, connector: str, hit_fraction: float
) -> dict:
    """Mean CPU ms per step with ``num_requests`` requests in the scheduler.

    ``decode``: 64-token prompts, all admitted during warm-up, then every step is
    one decode token for each of them. ``prefill``: 1024-token prompts that finish
    after their first token (``max_tokens=1``); every finished request is replaced
    by a fresh one between steps (outside the timed region), so the scheduler
    always holds ``num_requests`` and every step fills its 8192-token budget with
    prefill (chunked). Prompts are distinct (no prefix-cache hits between them).
    """
    from tests.v1.core.utils import create_requests
    from vllm.v1.outputs import ModelRunnerOutput

    if mode == "decode":
        prompt, batched, warmup, max_tokens = 64, max(8192, num_requests * 64), 2, 4096
        pool_size = num_requests
    else:
        prompt, batched, warmup, max_tokens = 1024, 8192, 2, 1
        # At most batched // computed-per-request requests finish per step.
        computed = prompt - int(prompt * hit_fraction) // BLOCK * BLOCK
        pool_size = num_requests + (steps + warmup) * (batched // computed + 1)
    hit = None
    if connector == "connector":
        hit = int(prompt * hit_fraction) // BLOCK * BLOCK
    sched = make_scheduler(
        hit,
        max_num_seqs=num_requests,
        max_num_batched_tokens=batched,
        max_model_len=prompt + 4096,
        enable_prefix_caching=True,
        num_blocks=num_requests * (prompt + 64) // BLOCK + 16
        if mode == "prefill"
        else num_requests * (prompt + 4096) // BLOCK + 16,
    )
    pool = create_requests(pool_size, num_tokens=prompt, max_tokens=max_tokens)
    pool.reverse()

    def top_up() -> None:
        while pool and len(sched.requests) < num_requests:
            sched.add_request(pool.pop())

    work = {"scheduled_tokens": 0, "finished": 0, "running_sum": 0}

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
        elapsed = time.process_time() - t0
        work["scheduled_tokens"] += out.total_num_scheduled_tokens
        work["finished"] += len(out.finished_req_ids)
        work["running_sum"] += len(ids)
        top_up()
        return elapsed

    top_up()
    for _ in range(warmup):
        one_step()
    work.update(dict.fromkeys(work, 0))
    total = sum(one_step() for _ in range(steps))
    row = {
        "mode": mode,
        "requests": num_requests,
        "connector": connector,
        "hit_tokens": hit or 0,
        "prompt_tokens": prompt,
        "cpu_ms_per_step": 1000.0 * total / steps,
        "scheduled_tokens": work["scheduled_tokens"],
        "finished": work["finished"],
        "scheduled_per_step": round(work["running_sum"] / steps, 1),
        "pool_left": len(pool),
    }
    if sched.connector is not None:
        row["connector_calls"] = dict(sched.connector.calls)
        cfg = sched.vllm_config.scheduler_config
        row["hma"] = not cfg.disable_hybrid_kv_cache_manager
    return row


def main() -> None:
    a = c.args()
    steps = int(a.get("steps", 20))
    hit_fraction = float(a.get("hit_fraction", 0.75))
    rows = []
    for connector in a.get("connectors", ["none", "connector"]):
        for mode in a.get("modes", ["decode", "prefill"]):
            for n in a.get("sizes", [64, 256]):
                rows.append(run(n, mode, steps, connector, hit_fraction))
    c.emit(
        {"steps": steps, "hit_fraction": hit_fraction, "rows": rows, **c.tree_info()}
    )


if __name__ == "__main__":
    main()
