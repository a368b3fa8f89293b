"""Throughput under a KV budget: one engine, one measured batch (``hmastack bench
--throughput``).

Usage: ``python -m hmastack_e2e.throughput PLAN_JSON OUT_JSON``

The plan is an engine plan (:class:`hmastack_e2e.engine.Plan` fields, with the
test connector and a KV cache pool) plus ``batch``: ``requests`` (N),
``prefix`` (tokens of each request's long prefix), ``suffix`` (tokens after
it) and ``max_tokens`` (tokens generated per request).

1. Store (not measured): N prompts, each its own ``prefix``-token document and a
   ``suffix``-token question, run once with ``load: none`` so the connector
   stores every full block; then the local prefix cache is emptied.
2. Measured: the same N prompts sent together, each prefix loaded by the
   connector synchronously (``load: sync``); ``max_tokens`` greedy tokens each.
   Wall and CPU seconds (``time.process_time``: the engine's own work, which a
   machine shared with other jobs does not inflate as it does the wall clock)
   from the first ``add_request`` to the last finished request, engine steps,
   the most requests running at once, the most blocks of each KV cache group
   in use at once (after every step), preemptions, and
   each request's cached-token count (must equal its external hit, else the
   connector did not serve it and the figure would be meaningless).

The prefixes differ between requests on purpose: a prefix shared by the batch
would be a local prefix cache hit from the second request on, and memory would
not bound the batch. Each request's prefix is in the connector's store (an
offloaded KV cache tier holding many documents), which is the case the series
changes: with HMA off every external token needs a block holding every layer;
from stage 3 a sliding-window group holds only its window.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from hmastack_e2e.models import BLOCK_SIZE


def prompts(batch: dict) -> list[list[int]]:
    """The N prompts: request i is prefix document i + suffix i (seeded)."""
    from hmastack_e2e.engine import prompt

    return [
        prompt(10_000 + i, batch["prefix"]) + prompt(20_000 + i, batch["suffix"])
        for i in range(batch["requests"])
    ]


def expected_hit(length: int) -> int:
    """The connector's hit of a prompt whose every full block is stored: whole
    blocks, at most ``length - 1`` tokens (the last token is recomputed), as
    ``scenarios._stored_prompt_hit``."""
    return min(length // BLOCK_SIZE * BLOCK_SIZE, length - 1)


class Timers:
    """CPU seconds of this process (``time.process_time``: what the engine
    did, whatever else the machine runs) spent in the connector's worker-side
    loads and saves and in each engine step of the measured batch (wrappers
    installed after the store phase): what does not shrink with concurrency (a
    load reads the same block files however many requests run) against what
    does (steps)."""

    def __init__(self, session):
        from hmastack_e2e import connector

        self.load = self.save = 0.0
        self.steps: list[float] = []
        # The most blocks in use at once (all KV cache groups: ref_cnt > 0, so
        # not the free cached ones), read from the block pool after each step.
        pool = session.scheduler.kv_cache_manager.block_pool
        self.peak_in_use = 0
        cls = connector.CPUTestConnector  # CPUTestHMAConnector inherits
        cls.start_load_kv = self._timed("load", cls.start_load_kv)
        cls.wait_for_save = self._timed("save", cls.wait_for_save)
        engine = session.llm.llm_engine
        step = engine.step

        def timed_step():
            t = time.process_time()
            try:
                return step()
            finally:
                self.steps.append(time.process_time() - t)
                in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
                self.peak_in_use = max(self.peak_in_use, in_use)

        engine.step = timed_step

    def _timed(self, name: str, fn):
        def wrapper(conn, *args, **kwargs):
            t = time.process_time()
            try:
                return fn(conn, *args, **kwargs)
            finally:
                setattr(self, name, getattr(self, name) + time.process_time() - t)

        return wrapper


def main(argv: list[str]) -> int:
    plan_path, out_path = Path(argv[0]), Path(argv[1])
    from hmastack_e2e.engine import Observation, Plan, Session

    raw = json.loads(plan_path.read_text())
    batch = raw.pop("batch")
    plan = Plan.from_json(raw)
    result: dict = {"plan": raw, "batch": batch}
    try:
        session = Session(plan)
        result["init_seconds"] = round(session.init_seconds, 2)
        result["groups"] = session.group_kinds()
        result["num_blocks"] = session.num_free_blocks()
        session.namespace = "throughput"
        reqs = prompts(batch)
        t0 = time.monotonic()
        session.run(
            [(f"store-{i}", p, {"load": "none"}, 0) for i, p in enumerate(reqs)],
            max_tokens=1,
        )
        session.reset_prefix_cache()
        result["store_seconds"] = round(time.monotonic() - t0, 3)
        obs = Observation()
        timers = Timers(session)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        records = session.run(
            [
                (f"req-{i}", p, {"load": "sync"}, expected_hit(len(p)))
                for i, p in enumerate(reqs)
            ],
            max_tokens=batch["max_tokens"],
            observation=obs,
        )
        result["seconds"] = time.perf_counter() - wall0
        result["cpu_seconds"] = time.process_time() - cpu0
        result["steps"] = obs.steps
        result["load_seconds"] = round(timers.load, 4)
        result["save_seconds"] = round(timers.save, 4)
        result["step_seconds"] = round(sum(timers.steps), 4)
        ordered = sorted(timers.steps)
        result["step_seconds_median"] = round(ordered[len(ordered) // 2], 5)
        result["max_running"] = obs.max_running
        result["max_waiting"] = obs.max_waiting
        result["preemptions"] = obs.preemptions
        # Per group, the most blocks all requests held at once (each group's
        # own maximum: the sum over groups may exceed the pool).
        result["peak_total_blocks"] = obs.peak_total_blocks
        result["peak_blocks_in_use"] = timers.peak_in_use
        # Per group, the most blocks one request held at once.
        result["peak_request_blocks"] = [
            max(col) for col in zip(*obs.peak_blocks.values(), strict=True)
        ]
        result["completed"] = len(records)
        result["generated_tokens"] = sum(len(r.tokens) for r in records)
        result["cached_tokens"] = sorted({r.num_cached_tokens for r in records})
        result["cache_mismatches"] = [
            f"{r.key}: {r.num_cached_tokens} cached tokens (want {r.expected_cached})"
            for r in records
            if r.num_cached_tokens != r.expected_cached
        ]
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    out_path.write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    return 3 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
