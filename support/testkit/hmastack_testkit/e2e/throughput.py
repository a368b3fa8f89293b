"""Throughput under a KV budget: one engine, one measured batch (``hmastack bench
--throughput``).

Usage: ``python -m hmastack_testkit.e2e.throughput PLAN_JSON OUT_JSON``

The plan is an engine plan (:class:`hmastack_testkit.e2e.engine.Plan` fields, with the
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

P/D with vLLM's NixlConnector (``role`` in the plan: ``producer`` or
``consumer``; two processes at once, NIXL over UCX and the side channel on
127.0.0.1, the pair's files in ``store_dir``):

* producer (not measured): prefills the N prompts with ``max_tokens=1`` and
  ``do_remote_decode``, writes their ``kv_transfer_params`` (the blocks to read,
  its side channel) to ``handoff.json`` and keeps stepping, so that its
  connector takes the consumer's notifications, until the consumer writes
  ``done``; reports the blocks it still holds then.
* consumer (measured, as step 2 above): the N prompts sent together with the
  producer's ``kv_transfer_params``; NixlConnector reads every prompt token but
  the last (the expected cached-token count). The load time is the
  NixlConnector's ``start_load_kv`` and ``get_finished`` (the reads are
  started and polled there). The KV budget bounds the consumer, the decode
  side.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from hmastack_testkit.e2e.models import BLOCK_SIZE
from hmastack_testkit.e2e.scenarios import read_handoff, wait_for, write_handoff


def prompts(batch: dict) -> list[list[int]]:
    """The N prompts: request i is prefix document i + suffix i (seeded)."""
    from hmastack_testkit.e2e.engine import prompt

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
        from hmastack_testkit.e2e import connector

        self.load = self.save = 0.0
        self.steps: list[float] = []
        # The most blocks in use at once (all KV cache groups: ref_cnt > 0, so
        # not the free cached ones), read from the block pool after each step.
        pool = session.scheduler.kv_cache_manager.block_pool
        self.peak_in_use = 0
        if session.plan.connector == "nixl":
            from vllm.distributed.kv_transfer.kv_connector.v1 import nixl_connector

            nixl = nixl_connector.NixlConnector
            # The reads start in start_load_kv and are polled in get_finished.
            nixl.start_load_kv = self._timed("load", nixl.start_load_kv)
            nixl.get_finished = self._timed("load", nixl.get_finished)
        else:
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


# How long one side of a P/D pair waits for the other (its files).
PAIR_WAIT_SECONDS = 400.0


def produce(session, batch: dict, result: dict) -> None:
    """The P/D producer: prefill, hand the transfer params over, keep stepping
    until the consumer is done and the blocks it read are back in the pool."""
    folder = session.plan.store_dir
    reqs = prompts(batch)
    free_before = session.num_free_blocks()
    t0 = time.monotonic()
    out = session.run(
        [(f"pd-{i}", p, {"do_remote_decode": True}, 0) for i, p in enumerate(reqs)],
        max_tokens=1,
    )
    result["prefill_seconds"] = round(time.monotonic() - t0, 3)
    params = [r.returned_kv_transfer_params for r in out]
    if not all(params):
        raise RuntimeError("the producer returned no kv_transfer_params")
    write_handoff(folder, params)
    wait_for(
        folder / "done",
        "consumer",
        step=session.llm.llm_engine.step,
        seconds=PAIR_WAIT_SECONDS,
    )
    # The consumer's last notifications reach the worker at its next steps.
    for _ in range(200):
        if session.num_free_blocks() == free_before:
            break
        session.llm.llm_engine.step()
        time.sleep(0.02)
    result["blocks_held_after_read"] = free_before - session.num_free_blocks()
    result["completed"] = len(out)


def requests_of(session, batch: dict, role: str | None, result: dict) -> list:
    """The measured requests (key, prompt, kv_transfer_params, expected cached
    tokens): a P/D consumer's come with the producer's transfer params; else
    the connector stores every prefix first (not measured)."""
    reqs = prompts(batch)
    if role == "consumer":
        folder = session.plan.store_dir
        handed = read_handoff(folder, seconds=PAIR_WAIT_SECONDS)
        # NixlConnector offers every prompt token but the last.
        return [(f"req-{i}", p, handed[i], len(p) - 1) for i, p in enumerate(reqs)]
    session.namespace = "throughput"
    t0 = time.monotonic()
    session.run(
        [(f"store-{i}", p, {"load": "none"}, 0) for i, p in enumerate(reqs)],
        max_tokens=1,
    )
    session.reset_prefix_cache()
    result["store_seconds"] = round(time.monotonic() - t0, 3)
    return [
        (f"req-{i}", p, {"load": "sync"}, expected_hit(len(p)))
        for i, p in enumerate(reqs)
    ]


def measure(session, batch: dict, role: str | None, result: dict) -> None:
    """The measured batch (the test connector's loads or a P/D consumer)."""
    from hmastack_testkit.e2e.engine import Observation

    measured = requests_of(session, batch, role, result)
    obs = Observation()
    timers = Timers(session)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        records = session.run(measured, max_tokens=batch["max_tokens"], observation=obs)
    finally:
        if role == "consumer":  # the producer may let go
            (session.plan.store_dir / "done").write_text("done")
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
    if role == "consumer":
        from hmastack_testkit.e2e import nixl_observe

        # Local blocks read without error and reported failed, all KV cache
        # groups (a block holds every layer with HMA off, one group's layers
        # with HMA on).
        result["nixl_blocks_read"] = sum(nixl_observe.READ.values())
        result["failed_loads"] = sum(len(b) for b in nixl_observe.FAILED.values())


def main(argv: list[str]) -> int:
    plan_path, out_path = Path(argv[0]), Path(argv[1])
    from hmastack_testkit.e2e.engine import Plan, Session

    raw = json.loads(plan_path.read_text())
    batch = raw.pop("batch")
    role = raw.pop("role", None)  # P/D with NixlConnector: producer | consumer
    plan = Plan.from_json(raw)
    result: dict = {"plan": {**raw, "role": role}, "batch": batch}
    try:
        session = Session(plan)
        result["init_seconds"] = round(session.init_seconds, 2)
        result["groups"] = session.group_kinds()
        result["num_blocks"] = session.num_free_blocks()
        if role == "producer":
            produce(session, batch, result)
        else:
            measure(session, batch, role, result)
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    out_path.write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    return 3 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
