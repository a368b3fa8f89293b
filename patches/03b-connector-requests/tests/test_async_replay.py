"""Stage 03: the asynchronous scheduling model replayed through the AsyncScheduler.

``spec/AsyncSched.tla`` models one request under asynchronous scheduling:
steps in flight in a batch queue, their outputs processed later, and the
in-flight fence of ``remove_skipped_blocks`` (patch
[00b.1 Don't free skipped blocks]: the blocks of the sliding window group that
leave the window are those skipped by
``num_computed_tokens - num_in_flight_tokens``, not by
``num_computed_tokens``, so no step in flight reads a freed slot). This file
follows its behaviours (``fixtures/async-replay/trace-*.json``, simulated from
``fixtures/replay-async.cfg``; or every ``trace-*.json`` of the directory
named by ``HMASTACK_ASYNC_REPLAY_TRACES``) through the real
``vllm.v1.core.sched.async_scheduler.AsyncScheduler``: one full attention
group and one sliding window group of W tokens, block size B, prefix caching
on.

The harness drives what the model chooses and a scheduler leaves to the
engine: when ``schedule()`` is called (the model's ``ScheduleWaiting`` or
``ScheduleRunning``: the request's step is appended to the queue) and when the
oldest step's output is processed (``UpdateFromOutput``: ``update_from_output``
with the token the step samples, or none for a prefill chunk). The token
budget is the model's ``Chunk``.

The behaviours of ``fixtures/async-replay-loads/`` (simulated from
``fixtures/replay-async-loads.cfg``) add the model's connector side. The
scheduler gets a ``SupportsHMA`` connector (``HoldingScriptedConnector`` of
``hmastack_testkit.scripted_connector``) that offers the first
``Ext`` prompt tokens past the local hit at every lookup, loaded
synchronously or asynchronously as the model chooses. A load that fails
(the model's ``SyncLoadFailedAt(j)`` and ``LoadFailedAt(j)``) is reported
with ``invalid_block_ids``, the request's blocks at slot ``j`` of each
table when the load was scheduled: with the output of the step that loads
(synchronous), or with ``finished_recving`` (asynchronous, as is a load
that succeeded, ``FinishLoad``). ``PreemptForMemory`` is a schedule in
which ``allocate_slots`` returns None once (memory taken by requests the
model leaves out), so the scheduler preempts the request.

After every step the scheduler is compared with the model: the request's
status, ``num_tokens`` (the model's ``len``), ``num_computed_tokens``,
``num_output_placeholders``, the steps in flight (their first token and
size), the leading null entries of its sliding window table (the model's
``skip``: null padding and the slots ``remove_skipped_blocks`` freed),
whether it is marked for a failed load (``mark``) and whether the outputs of
its steps in flight are dropped (``discard``), both read by
``connector_state``. A mismatch fails with the trace, the step and both
states.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import pytest
from hmastack_testkit import traces
from hmastack_testkit.kvtest import (
    make_cpu_vllm_config,
    make_kv_cache_groups,
    make_scheduler,
    model_runner_output,
)
from hmastack_testkit.scripted_connector import Offer
from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

FIXTURES = Path(__file__).parent / "fixtures" / "async-replay"
LOAD_FIXTURES = Path(__file__).parent / "fixtures" / "async-replay-loads"
NUM_BLOCKS = 32  # the null block included: memory is never short
REQ = "r"
# A token that is neither EOS nor a prompt token.
SAMPLED = 7


def trace_files() -> list[Path]:
    folder = os.environ.get("HMASTACK_ASYNC_REPLAY_TRACES")
    if folder:
        return sorted(Path(folder).glob("trace-*.json"))
    return sorted(FIXTURES.glob("trace-*.json")) + sorted(
        LOAD_FIXTURES.glob("trace-*.json")
    )


def connector_state(sched, req_id: str) -> dict:
    """The scheduler's connector state of one request: marked for a failed
    load (the model's ``mark``), its outputs in flight dropped
    (``discard``) and, while it waits for an asynchronous load, the tokens it
    counts as computed once the load is done (``loaded``; None otherwise,
    or once the load failed: ``num_computed_tokens`` then holds them)."""
    record = sched.kv_connector_requests.get(req_id)
    if record is None:
        return {"mark": False, "discard": False, "loaded": None}
    return {
        "mark": record.load_failed,
        "discard": record.discard_output,
        "loaded": (
            None if record.failed_recving else record.num_computed_tokens_after_recving
        ),
    }


STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.PREEMPTED: "waiting",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "loading",
    RequestStatus.RUNNING: "running",
}


class Mismatch(AssertionError):
    pass


class AsyncReplay:
    """An AsyncScheduler with one request, driven by a model behaviour."""

    def __init__(self, constants: dict):
        self.c = constants
        b, w = constants["B"], constants["W"]
        kv_transfer = None
        if constants["Ext"] > 0:
            assert constants["ConnectorHMA"], "the replay connector uses HMA"
            kv_transfer = KVTransferConfig(
                kv_connector="HoldingScriptedConnector",
                kv_connector_module_path="hmastack_testkit.scripted_connector",
                kv_role="kv_both",
            )
        vllm_config = make_cpu_vllm_config(
            b,
            NUM_BLOCKS,
            kv_transfer,
            max_num_seqs=1,
            max_num_batched_tokens=constants["Chunk"],
            max_model_len=constants["MaxLen"] + 1,
        )
        vllm_config.scheduler_config.async_scheduling = True
        self.sched = make_scheduler(
            vllm_config,
            KVCacheConfig(
                num_blocks=NUM_BLOCKS,
                kv_cache_tensors=[],
                kv_cache_groups=make_kv_cache_groups(["full", "sliding_window"], b, w),
            ),
            scheduler_cls=AsyncScheduler,
        )
        self.request = Request(
            request_id=REQ,
            prompt_token_ids=[100 + i for i in range(constants["PromptLen"])],
            sampling_params=SamplingParams(
                max_tokens=constants["MaxLen"] - constants["PromptLen"],
                ignore_eos=True,
            ),
            pooling_params=None,
            eos_token_id=None,
            block_hasher=get_request_block_hasher(b, sha256),
        )
        self.connector = self.sched.connector
        self.sched.add_request(self.request)
        # The steps in flight, oldest first: (SchedulerOutput, first token,
        # tokens scheduled, the request's block ids when it was scheduled).
        self.queue: deque[tuple[SchedulerOutput, int, int, tuple]] = deque()
        # The steps in flight that sample a token (ids of their outputs).
        self.sampling: set[int] = set()
        self.done = False

    def block_ids(self) -> tuple:
        return self.sched.kv_cache_manager.get_block_ids(REQ)

    def schedule(self, load_async: bool = False) -> None:
        if self.connector is not None:
            # The model's offer (ExtOffer): the first Ext prompt tokens, past
            # the local hit at every lookup, loaded as the model chooses.
            self.connector.offer = Offer(self.c["Ext"], load_async)
        out = self.sched.schedule()
        n = out.num_scheduled_tokens.get(REQ, 0)
        if load_async:
            if n:
                raise Mismatch("the model loads asynchronously, the scheduler runs")
            return
        if n == 0:
            raise Mismatch("the model schedules a step, the scheduler none")
        first = self.request.num_computed_tokens - n
        self.queue.append((out, first, n, self.block_ids()))

    def preempt_for_memory(self) -> None:
        """A schedule in which allocate_slots finds no free block."""
        manager = self.sched.kv_cache_manager
        allocate = manager.allocate_slots
        manager.allocate_slots = lambda *args, **kwargs: None
        try:
            out = self.sched.schedule()
        finally:
            manager.allocate_slots = allocate
        if self.request.status == RequestStatus.RUNNING and not (
            out.num_scheduled_tokens.get(REQ, 0)
        ):
            # It has no token to schedule (its steps in flight reach its
            # last one), so allocate_slots is not called for it: it is the
            # victim of another request's allocate_slots, as schedule()
            # preempts one (the last of the running queue).
            self.sched.running.remove(self.request)
            self.sched._preempt_request(self.request, 0.0)
        if out.num_scheduled_tokens.get(REQ, 0) or self.request.status not in (
            RequestStatus.PREEMPTED,
            RequestStatus.WAITING,
        ):
            raise Mismatch(
                "the model preempts for memory, the scheduler does not "
                f"({self.request.status}, {len(self.queue)} steps in flight)"
            )

    @staticmethod
    def invalid_at(block_ids: tuple, j: int) -> set[int]:
        """The blocks at slot j of each table (a load failed from block j)."""
        return {ids[j] for ids in block_ids if j < len(ids) and ids[j] != 0}

    def update_oldest(self, failed_at: int | None = None) -> None:
        """The oldest step's output: the token it samples (when it reached the
        request's last token), or none for a prefill chunk; with
        ``failed_at``, its synchronous load failed from that block on."""
        out, _, _, block_ids = self.queue.popleft()
        tokens = [SAMPLED] if id(out) in self.sampling else []
        self.sampling.discard(id(out))
        kv = None
        if failed_at is not None:
            kv = KVConnectorOutput(
                invalid_block_ids=self.invalid_at(block_ids, failed_at)
            )
        runner = model_runner_output(
            [REQ],
            [tokens],
            kv_connector_output=kv,
        )
        self.sched.update_from_output(out, runner)
        if self.request.is_finished():
            self.done = True

    def load_done(self, failed_at: int | None = None) -> None:
        """The worker reports the end of the asynchronous load (no step in the
        output); with ``failed_at``, it failed from that block on."""
        invalid = (
            set() if failed_at is None else self.invalid_at(self.block_ids(), failed_at)
        )
        self.sched.update_from_output(
            SchedulerOutput.make_empty(),
            model_runner_output(
                [],
                [],
                kv_connector_output=KVConnectorOutput(
                    finished_recving={REQ}, invalid_block_ids=invalid
                ),
            ),
        )

    def state(self) -> dict:
        """The model's view of the scheduler."""
        r = self.request
        manager = self.sched.kv_cache_manager
        status = "done" if self.done else STATUS[r.status]
        conn = connector_state(self.sched, REQ)
        loaded = conn.pop("loaded")
        computed = 0 if self.done else r.num_computed_tokens
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and loaded is not None:
            computed = loaded
        if status == "loading" and self.sched.kv_connector_requests.is_finished_recving(
            REQ
        ):
            # Reported: it waits to be scheduled (the model's FinishLoad).
            status = "waiting"
        skip = 0
        if not self.done:
            swa = manager.coordinator.single_type_managers[1].req_to_blocks.get(REQ, [])
            for block in swa:
                if not block.is_null:
                    break
                skip += 1
        return {
            "status": status,
            "len": r.num_tokens,
            "computed": computed,
            "ph": 0 if self.done else r.num_output_placeholders,
            "queue": [(first, n) for _, first, n, _ in self.queue],
            "skip": skip,
            **conn,
        }


def model_view(st: dict) -> dict:
    return {
        "status": st["status"],
        "len": st["len"],
        "computed": st["computed"],
        "ph": st["ph"],
        "queue": [(s["from"], s["n"]) for s in st["queue"]],
        "skip": st["skip"],
        "mark": st["mark"],
        "discard": st["discard"],
    }


def replay(doc: traces.Trace) -> int:
    """Replays one behaviour; returns the steps compared."""
    init_none_hash(sha256)
    states = doc.states
    c = doc.constants
    rp = AsyncReplay(c)
    bs = c["B"]
    for k in range(1, len(states)):
        before, after = states[k - 1], states[k]
        failed = after["failures"] > before["failures"]
        if after["preempts"] > before["preempts"]:
            rp.preempt_for_memory()
        elif before["status"] == "waiting" and after["status"] == "loading":
            rp.schedule(load_async=True)
        elif before["status"] == "loading" and after["status"] == "waiting":
            j = None
            if failed:
                lo = before["load"]["from"] // bs
                hi = (before["load"]["from"] + before["load"]["e"]) // bs - 1
                j = after["computed"] // bs if after["computed"] > 0 else lo
                j = min(max(j, lo), hi)
            rp.load_done(j)
        elif len(after["queue"]) > len(before["queue"]):
            step = after["queue"][-1]
            rp.schedule()
            if step["sample"]:
                rp.sampling.add(id(rp.queue[-1][0]))
        elif len(after["queue"]) < len(before["queue"]):
            j = None
            if failed:
                head = before["queue"][0]
                lo = (head["from"] - head["e"]) // bs
                hi = head["from"] // bs - 1
                if before["status"] == "running" and after["status"] == "running":
                    j = after["computed"] // bs
                elif after["cached"] < before["cached"]:
                    j = after["cached"]
                else:
                    j = max(lo, before["cached"])
                j = min(max(j, lo), hi)
            rp.update_oldest(j)
        else:
            raise Mismatch(f"trace {doc.get('index')} step {k}: an action not replayed")
        want, got = model_view(after), rp.state()
        if want != got:
            diff = {key: (want[key], got[key]) for key in want if want[key] != got[key]}
            raise Mismatch(
                f"{doc.model} trace {doc.index} step {k}: model != "
                f"scheduler {diff}\nmodel {want}\nscheduler {got}"
            )
    return len(states) - 1


def test_async_replay_fixtures_exist():
    files = trace_files()
    assert files, f"no trace-*.json under {FIXTURES}"
    # The fixtures exercise what the fence guards: a slide of the window
    # while a step is in flight.
    slides = 0
    for path in files:
        states = traces.read(path).states
        slides += sum(
            1
            for a, b in zip(states, states[1:], strict=False)
            if b["skip"] > a["skip"] and a["queue"] and a["status"] == "running"
        )
    assert slides > 0, "no behaviour slides the window with a step in flight"
    # And what DropFreedOutput guards: a request preempted for memory while
    # the step of its synchronous load is in flight, then that load fails.
    freed_failures = 0
    for path in files:
        states = traces.read(path).states
        freed_failures += sum(
            1
            for a, b in zip(states, states[1:], strict=False)
            if b["failures"] > a["failures"]
            and a["status"] == "waiting"
            and a["queue"]
            and a["queue"][0]["e"] > 0
            and not a["discard"]
        )
    assert freed_failures > 0 or os.environ.get("HMASTACK_ASYNC_REPLAY_TRACES"), (
        "no behaviour fails the load of a request preempted with its step in flight"
    )


@pytest.mark.parametrize(
    "path",
    trace_files(),
    ids=lambda p: p.stem if p.parent == FIXTURES else f"loads-{p.stem}",
)
def test_async_replay(path: Path):
    assert replay(traces.read(path)) > 0
