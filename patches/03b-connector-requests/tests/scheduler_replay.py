"""Stage 03: the harness that replays behaviours of the model (Series) through
vLLM's Scheduler (``test_scheduler_replay.py`` runs it).

``test_replay.py`` follows the model's behaviours with the ``KVCacheManager``
alone. This harness follows the same behaviours (``fixtures/replay/trace-*.json``,
or every ``trace-*.json`` of the directory named by ``HMASTACK_REPLAY_TRACES``)
through the real ``vllm.v1.core.sched.scheduler.Scheduler``: a hybrid
``KVCacheConfig`` (one full attention group, one sliding window group of W
tokens, block size B, N + 1 blocks with the null block, prefix caching on) and
a scheduler-side KV connector that subclasses ``SupportsHMA``
(``ReplayConnector``), scripted per request by the model's event.

What the scheduler decides by itself: prefix-cache hits, the blocks of every
group (``allocate_slots`` with external tokens, null blocks for skipped
tokens), whether a request fits or must be preempted and which request is
preempted, status changes, when blocks are freed (also the delayed free of a
request aborted during its load), what is cached and when.

What the harness controls (the model's choices, which a scheduler leaves to
its clients, its connector and the model runner):

* which request the scheduler sees: for each ``schedule()`` call, requests that
  the model does not step are held out of ``running`` and ``waiting`` and put
  back afterwards in their order (so two requests' steps may be in flight at
  once, each with its own ``SchedulerOutput``, as with pipelining);
* how many tokens: ``max_num_scheduled_tokens`` is set to the model's ``n``
  (+ ``d``) for that call; ``d`` draft tokens are the request's
  ``spec_token_ids`` (spec decode without lookahead slots: the scheduler
  schedules them in ``num_new_tokens`` and ``update_from_output`` takes the
  rejected ones back);
* the connector's answer: ``get_num_new_matched_tokens`` returns the model's
  ``ext`` and ``async``; it checks that the scheduler's local hit is the
  model's ``hit``; ``update_state_after_alloc`` records the blocks a load
  writes into (from the block tables the scheduler hands over);
* the model runner's answer: ``update_from_output`` with the sampled tokens
  (``accepted`` + 1 at the end of the prompt, none for a prefill chunk),
  ``finished_recving`` when the model's load ends, ``invalid_block_ids`` (the
  load's first full attention block) when it fails, ``finished_sending`` when
  the model's stores that outlive the step end (``SaveDone``);
* the stores that outlive the step (``SaveMode = "async"``): the connector's
  ``request_blocks_freed`` names the freed blocks that the model's ``saves``
  still read, and ``request_finished_all_groups`` delays the free while the
  model saves; the scheduler holds and frees the blocks (compared with the
  model's ``held``);
* a load that ended is taken up with ``Scheduler._update_waiting_for_remote_kv``
  and ``status = WAITING``, the first lines of ``schedule()``'s waiting loop,
  called directly because ``schedule()`` would also schedule the request in
  the same call where the model takes a separate step;
* the eviction choice: before each allocation the free queue is reordered so
  that its head holds the blocks the model takes (``kvtest.steer_free_queue``;
  the model may evict any cached free block, vLLM evicts its LRU head).

After every step an abstraction of the scheduler is compared with the model
state: every table of every request (null entries, real blocks through a
bijection model block <-> real block built from the new blocks' positions),
``ref_cnt`` of every model block, the free queue size, the number of distinct
prefix-cache keys, the blocks each in-flight load writes into (the connector's
pending loads) and each record's ``recving``, each request's status (waiting /
loading / running / finishing / done), ``num_tokens``, ``num_computed_tokens``
(not while loading: the model counts the external tokens already), and the
order of ``Scheduler.running``. A mismatch fails with the trace, the step and
both states.

Not compared, the trace stops there and the stop is counted by cause:

* the model evicts other cached blocks than vLLM even after steering (a
  block freed in the same step), or the only block of a prefix-cache key of
  which vLLM also caches a duplicate (``diverged``);
* see ``STOP_*`` below for the events that cannot be driven through the
  scheduler faithfully.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hmastack_testkit import scripted_connector as scripted
from hmastack_testkit import traces
from hmastack_testkit.kvtest import (
    REPLAY_POLICIES,
    AdmissionSpy,
    SkippedBlocksSpy,
    bind_new_blocks,
    compare_pool,
    compare_table,
    make_cpu_vllm_config,
    make_scheduler,
    model_hit_blocks,
    model_runner_output,
    steer_free_queue,
    steer_hits,
)
from hmastack_testkit.scripted_connector import Offer
from vllm.config import (
    KVTransferConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

init_none_hash(sha256)

TRACES_ENV = "HMASTACK_REPLAY_TRACES"
FIXTURES = Path(__file__).parent / "fixtures" / "replay"
GROUPS = ("full", "swa")
MODEL = "facebook/opt-125m"  # config only (no weights, no tokenizer)

# Stop causes: events or outcomes that the scheduler cannot follow faithfully.
STOP_DRAFT_WAITING = "draft tokens for a request leaving the waiting queue"
STOP_SYNC_FAIL_UNAFFECTED = (
    "sync load failure that does not affect the failing request: the scheduler "
    "processes its output in the same update, the model returns it later"
)
STOP_PREEMPT_SPLIT = (
    "preemption by another request: schedule() retries the preempting request "
    "in the same call, the model steps another process in between"
)


class Mismatch(AssertionError):
    pass


class Diverged(Exception):
    """The model chose another eviction than vLLM's LRU: stop this trace."""


class Stop(Exception):
    """A step the scheduler cannot follow faithfully: stop this trace."""


def trace_paths() -> list[Path]:
    """The committed fixtures, or the traces of ``$HMASTACK_REPLAY_TRACES``."""
    directory = Path(os.environ.get(TRACES_ENV) or FIXTURES)
    return sorted(directory.glob("trace-*.json"))


# ---------------------------------------------------------------------------
# The scripted connector (scheduler side).


class ReplayConnector(scripted.HoldingScriptedConnector):
    """The scripted ``SupportsHMA`` connector
    (``hmastack_testkit.scripted_connector``) as the replay drives it.

    ``offers[req_id]`` is the model's answer for the request's lookup (its
    ``extTokens`` past the local hit, ``past_hit``; set before a ``schedule()``
    and dropped after it); an async load stays in ``pending`` until
    ``finished_recving`` reports it. ``stores`` (set by the replay from the
    model's stores that outlive the step) are the blocks its stores still
    read: ``request_blocks_freed`` names them, and
    ``request_finished_all_groups`` delays the free while there are any.

    What a connector that saves inside the step learns from the scheduler
    output is followed too: each request's block table (``tables``), and the
    table slots <<group, slot, block id>> the last step fills
    (``step_saves``, saved during it).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self.tables: dict[str, list[list[int]]] = {}
        self.step_saves: dict[str, set[tuple[str, int, int]]] = {}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Follow the block tables the scheduler hands over and note the slots
        each scheduled step fills (a connector saving inside the step saves
        them while the step runs)."""
        so = scheduler_output
        self.step_saves = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self._note_saves(so, new.req_id, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or req_id not in self.tables:
                self.tables[req_id] = [list(g) for g in ids or ()]
            elif ids is not None:
                for table, more in zip(self.tables[req_id], ids, strict=True):
                    table.extend(more)
            self._note_saves(so, req_id, cached.num_computed_tokens[i])
        return super().build_connector_meta(scheduler_output)

    def _note_saves(self, so, req_id: str, num_computed: int) -> None:
        assert self._kv_cache_config is not None
        size = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        verified = so.num_scheduled_tokens[req_id] - len(
            so.scheduled_spec_decode_tokens.get(req_id, ())
        )
        slots = range(num_computed // size + 1, (num_computed + verified) // size + 1)
        self.step_saves[req_id] = {
            (GROUPS[g], i, table[i - 1])
            for g, table in enumerate(self.tables[req_id])
            for i in slots
            if i <= len(table) and table[i - 1] != 0
        }


# ---------------------------------------------------------------------------
# The scheduler under replay.

_CONFIGS: dict[tuple[int, int], VllmConfig] = {}


def replay_vllm_config(block_size: int, num_blocks: int) -> VllmConfig:
    """A CPU VllmConfig with prefix caching and the replay connector (cached:
    building it takes a few tens of ms; the Scheduler is new per trace)."""
    key = (block_size, num_blocks)
    if key not in _CONFIGS:
        config = make_cpu_vllm_config(
            block_size,
            num_blocks,
            KVTransferConfig(
                kv_connector=ReplayConnector.__name__,
                kv_connector_module_path=__name__,
                kv_role="kv_both",
            ),
            max_num_seqs=16,
            max_num_batched_tokens=64,
        )
        _CONFIGS[key] = config
    return _CONFIGS[key]


def pc_only(before: dict, after: dict) -> bool:
    """A process left its loop: no step of the scheduler."""
    return all(before[v] == after[v] for v in after if v != "pc")


class Replay:
    """One behaviour of the model followed with a real Scheduler."""

    def __init__(self, constants: dict):
        # Reorder the free queue to the model's eviction choice
        # (kvtest.steer_free_queue).
        self.steer = True
        c = self.c = constants
        assert c["Policy"] in REPLAY_POLICIES and c["Mutation"] == "none", c
        # A connector that uses HMA, with two KV cache groups (the model's
        # ConnectorHMA, TRUE where a behaviour does not name it).
        assert c.get("ConnectorHMA", True), "the replay drives two KV cache groups"
        # A sliding window beside full attention (the model's Kind, "swa"
        # where a behaviour does not name it): stage 03 has no Mamba group.
        assert c.get("Kind", "swa") == "swa", "the replay drives a sliding window"
        self.B, self.N = c["B"], c["N"]
        groups = [
            KVCacheGroupSpec(["full"], FullAttentionSpec(self.B, 1, 1, torch.float32)),
            KVCacheGroupSpec(
                ["swa"],
                SlidingWindowSpec(self.B, 1, 1, torch.float32, sliding_window=c["W"]),
            ),
        ]
        config = replay_vllm_config(self.B, self.N + 1)
        self.sched = make_scheduler(
            config,
            KVCacheConfig(
                num_blocks=self.N + 1, kv_cache_tensors=[], kv_cache_groups=groups
            ),
        )
        conn = self.sched.connector
        assert isinstance(conn, ReplayConnector) and isinstance(conn, SupportsHMA)
        self.conn: ReplayConnector = conn
        self.pool = self.sched.kv_cache_manager.block_pool
        self.managers = self.sched.kv_cache_manager.coordinator.single_type_managers
        self.skipped_spy = SkippedBlocksSpy(self.sched.kv_cache_manager.coordinator)
        self.admission = AdmissionSpy(self.sched.kv_cache_manager.coordinator)
        self.expect_skipped_free: tuple[str, int] | None = None
        assert len(self.managers) == len(GROUPS)
        # Record evictions (cached blocks handed out again) as vLLM makes them.
        self.evicted: list[int] = []
        evict = self.pool._maybe_evict_cached_block

        def spy(block):
            evicted = evict(block)
            if evicted:
                self.evicted.append(block.block_id)
            return evicted

        self.pool._maybe_evict_cached_block = spy
        self.requests: dict[str, Request] = {}
        for k, r in enumerate(c["Req"]):
            shared = list(range(c["Shared"]))
            own = [1000 * (k + 1) + i for i in range(c["Shared"], c["PromptLen"])]
            request = Request(
                request_id=r,
                prompt_token_ids=shared + own,
                sampling_params=SamplingParams(max_tokens=c["MaxLen"] - c["PromptLen"]),
                pooling_params=None,
                eos_token_id=None,
                block_hasher=get_request_block_hasher(self.B, sha256),
            )
            self.requests[r] = request
            self.sched.add_request(request)
        self.m2r: dict[int, int] = {}  # model block id -> real block id
        self.r2m: dict[int, int] = {}
        # Prefix-cache keys of the model <-> block hashes of vLLM.
        self.key2hash: dict[tuple, Any] = {}
        self.hash2key: dict[Any, tuple] = {}
        # The scheduler output of each request's step in flight.
        self.inflight: dict[str, SchedulerOutput] = {}

    # ---- driving the scheduler ----
    def _queue(self, requests):
        queue = create_request_queue(self.sched.policy)
        for request in requests:
            queue.add_request(request)
        return queue

    def schedule(
        self, active: list[str], budget: int, first: str | None = None
    ) -> SchedulerOutput:
        """``Scheduler.schedule()`` seeing only the ``active`` requests (the
        others are held out of its queues and put back in their places) with a
        token budget of ``budget``; ``first``: put at the front of the waiting
        queue."""
        s = self.sched
        run0, wait0 = list(s.running), list(s.waiting)
        s.running = [q for q in run0 if q.request_id in active]
        seen = [q for q in wait0 if q.request_id in active]
        seen.sort(key=lambda q: q.request_id != first)
        s.waiting = self._queue(seen)
        s.max_num_scheduled_tokens = budget
        # Requests a load failure preempted (_handle_invalid_blocks) are
        # reported with the next output, whichever requests it schedules: the
        # model's SyncLoadFailed step took them out already.
        reported = {
            r
            for r, record in s.kv_connector_requests.items()
            if record.preempted_to_report
        }
        try:
            out = s.schedule()
            if not reported <= out.preempted_req_ids:
                raise Mismatch(
                    f"schedule() reports {sorted(out.preempted_req_ids)} preempted, "
                    f"not the requests a load failure preempted {sorted(reported)}"
                )
            out.preempted_req_ids -= reported
            return out
        finally:
            run1, wait1 = list(s.running), list(s.waiting)
            s.running = [q for q in run0 if q.request_id not in active or q in run1] + [
                q for q in run1 if q not in run0
            ]
            s.waiting = self._queue(
                wait1 + [q for q in wait0 if q.request_id not in active]
            )

    def runner_output(
        self,
        tokens: dict[str, list[int]],
        finished_recving: set[str] | None = None,
        invalid_block_ids: set[int] | None = None,
        finished_sending: set[str] | None = None,
    ) -> ModelRunnerOutput:
        ids = list(tokens)
        kv = None
        if finished_recving or invalid_block_ids or finished_sending:
            kv = KVConnectorOutput(
                finished_recving=finished_recving,
                finished_sending=finished_sending,
                invalid_block_ids=invalid_block_ids or set(),
            )
        return model_runner_output(
            ids,
            [tokens[r] for r in ids],
            kv_connector_output=kv,
        )

    def transfer_done(self, r: str, invalid_block_ids: set[int] | None = None):
        """The worker reports the end of r's load (no step in the output)."""
        self.sched.update_from_output(
            SchedulerOutput.make_empty(),
            self.runner_output({}, {r}, invalid_block_ids),
        )

    def save_done(self, r: str) -> None:
        """The worker reports the end of r's stores (no step in the output)."""
        self.sched.update_from_output(
            SchedulerOutput.make_empty(),
            self.runner_output({}, finished_sending={r}),
        )

    def mirror_saves(self, state: dict) -> None:
        """The connector's stores that outlive the step are the model's
        (through the bijection); saves inside the step hold nothing."""
        if self.c["SaveMode"] != "async":
            return
        self.conn.stores = {
            r: {self.m2r[m] for _g, _i, m in blocks if m in self.m2r}
            for r, blocks in state["saves"].items()
            if blocks
        }

    def take_up_load(self, r: str) -> None:
        """The head of schedule()'s waiting loop for a request whose load ended."""
        request = self.requests[r]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if not self.sched._update_waiting_for_remote_kv(request):
            raise Mismatch(f"load of {r} reported but not ready")
        request.status = RequestStatus.WAITING

    # ---- real state ----
    def real_tables(self, r: str) -> dict[str, list[int]]:
        return {
            g: [b.block_id for b in m.req_to_blocks.get(r, [])]
            for g, m in zip(GROUPS, self.managers, strict=True)
        }

    def cached_real(self) -> dict[int, Any]:
        return {
            b.block_id: b.block_hash
            for b in self.pool.blocks
            if not b.is_null and b.block_hash is not None
        }

    def real_status(self, r: str) -> str:
        request = self.requests[r]
        if r not in self.sched.requests:
            return "done"
        if request.is_finished():
            return "finishing"
        return {
            RequestStatus.WAITING: "waiting",
            RequestStatus.PREEMPTED: "waiting",
            RequestStatus.WAITING_FOR_REMOTE_KVS: "loading",
            RequestStatus.RUNNING: "running",
        }.get(request.status, str(request.status))

    # ---- steps ----
    def allocate(self, before: dict, ev: dict, after: dict | None) -> SchedulerOutput:
        """schedule() for the model's AllocateSlots (``after``: its state) or
        Refused (``after`` None: nothing to steer, nothing may be scheduled)."""
        r, a = ev["req"], ev["args"]
        request = self.requests[r]
        fresh = before["status"][r] == "waiting" and before["computed"][r] == 0
        if a["draftTokens"] and before["status"][r] != "running":
            raise Stop(STOP_DRAFT_WAITING, f"{r}: d={a['draftTokens']}")
        if fresh:
            ext = a["extTokens"]
            if r in before["noLoad"] and ext == 0:
                # Patch [00c.4 No new KV load]: a request whose load left it no
                # valid token takes no external tokens; the connector offers
                # some anyway (as a connector whose store still lists them
                # does), the scheduler must take 0.
                ext = before["len"][r] - 1 - a["hitBlocks"] * self.B
            self.conn.offers[r] = Offer(ext, a["async"], past_hit=True)
        if a["draftTokens"]:
            request.spec_token_ids = [9000 + i for i in range(a["draftTokens"])]
        self.evicted.clear()
        self.conn.lookups.pop(r, None)
        self.skipped_spy.calls.clear()
        self.admission.counts.clear()
        self.expect_skipped_free = None
        if self.steer and after is not None:
            if r in self.managers[0].req_to_blocks:
                # allocate_slots frees the skipped blocks before it allocates;
                # do it first so the freed blocks can be steered too (the call
                # in allocate_slots then finds them null and frees nothing).
                # check_allocation verifies that allocate_slots makes that call.
                n = request.num_computed_tokens - request.num_in_flight_tokens
                # As allocate_slots: the blocks a store still reads are held.
                freed = self.skipped_spy.free_now(r, n)
                if freed:
                    self.sched.kv_cache_manager._hold_blocks(r, freed)
                self.expect_skipped_free = (r, n)
            order = [m for g in GROUPS for m in ev["blocks"][g]]
            steer_free_queue(self.pool, self.m2r, self.r2m, order)
            if fresh:
                # The model's hit blocks (any block of their key) first.
                steer_hits(
                    self.pool,
                    model_hit_blocks(self.m2r, after["table"][r], a["hitBlocks"]),
                )
        out = self.schedule([r], max(a["newTokens"] + a["draftTokens"], 1))
        self.conn.offers.pop(r, None)
        return out

    def check_allocation(self, before: dict, after: dict, ev: dict, out) -> None:
        """The scheduler scheduled what the model's AllocateSlots did, evicted
        the model's blocks; bind the model's new blocks to vLLM's."""
        r, a = ev["req"], ev["args"]
        if before["status"][r] == "waiting" and before["computed"][r] == 0:
            local = self.conn.lookups.get(r)
            if local != a["hitBlocks"] * self.B:
                raise Mismatch(
                    f"prefix cache hit: vLLM {local} tokens, model "
                    f"{a['hitBlocks']} blocks"
                )
        scheduled = out.num_scheduled_tokens.get(r, 0)
        expected = self.expect_skipped_free
        if expected is not None and expected not in self.skipped_spy.calls:
            raise Mismatch(
                f"allocate_slots did not free the skipped blocks {expected} "
                f"(remove_skipped_blocks calls: {self.skipped_spy.calls})"
            )
        if r in out.preempted_req_ids or scheduled != a["newTokens"] + a["draftTokens"]:
            raise Mismatch(
                f"schedule(): {r} scheduled {scheduled} tokens, preempted "
                f"{sorted(out.preempted_req_ids)}; model: {a['newTokens']} new, "
                f"{a['draftTokens']} draft tokens "
                f"(predicted {a['predictedBlocks']} blocks)"
            )
        if (
            a["draftTokens"]
            and len(out.scheduled_spec_decode_tokens.get(r, ())) != a["draftTokens"]
        ):
            raise Mismatch(
                f"draft tokens scheduled: {out.scheduled_spec_decode_tokens}"
            )
        if self.admission.counts[-1:] != [a["predictedBlocks"]]:
            raise Mismatch(
                f"get_num_blocks_to_allocate: vLLM {self.admission.counts}, "
                f"model {a['predictedBlocks']}"
            )
        model_new = set(ev["blocks"]["full"]) | set(ev["blocks"]["swa"])
        model_evicted = {m for m in model_new if before["hash"][m - 1]}
        if {self.m2r.get(m) for m in model_evicted} != set(self.evicted):
            raise Diverged(
                f"model evicts {sorted(model_evicted)}, vLLM evicts "
                f"{sorted(self.r2m.get(x, x) for x in self.evicted)} (as model ids)"
            )
        bind_new_blocks(
            self.m2r, self.r2m, after["table"][r], self.real_tables(r), ev["blocks"]
        )
        if not a["async"]:
            self.inflight[r] = out
        if not a["async"] and self.c["SaveMode"] == "step":
            # Saves inside the step: the slots the model's connector saves are
            # the ones the scheduler output lets a connector find.
            model_saves = {
                (g, i, self.m2r.get(m, f"?{m}")) for g, i, m in after["saves"][r]
            }
            if model_saves != self.conn.step_saves.get(r, set()):
                raise Mismatch(
                    f"saved slots of {r}: model {sorted(model_saves, key=str)}, "
                    f"connector {sorted(self.conn.step_saves.get(r, set()))}"
                )

    def refused(self, before: dict, ev: dict) -> None:
        """The model refuses waiting request r: schedule() must not schedule
        it (nor preempt), with the same admission count."""
        r, a = ev["req"], ev["args"]
        out = self.allocate(before, ev, None)
        if r in out.num_scheduled_tokens or out.preempted_req_ids:
            raise Mismatch(
                f"schedule() scheduled {out.num_scheduled_tokens}, preempted "
                f"{sorted(out.preempted_req_ids)}; the model refuses {r} "
                f"({a['predictedBlocks']} blocks, {a['freeBlocks']} free)"
            )
        if self.admission.counts[-1:] != [a["predictedBlocks"]]:
            raise Mismatch(
                f"get_num_blocks_to_allocate: vLLM {self.admission.counts}, "
                f"model {a['predictedBlocks']} (refused)"
            )

    def free_waiting(self, before: dict, after: dict, ev: dict) -> None:
        """The stall fix (patch [00a.4 Fix a stall]): ``schedule()`` with the
        model's head ``h`` first in the waiting queue, the requests the model
        frees behind it and
        nothing running. The connector answers for ``h`` as in the model's
        refusal; ``allocate_slots`` must refuse ``h`` with the model's
        admission count, and ``_free_blocks_of_waiting_requests`` must free
        exactly the model's requests (their tables and computed tokens are
        compared after the step)."""
        h, a = ev["req"], ev["args"]
        if before["status"][h] == "waiting" and before["computed"][h] == 0:
            self.conn.offers[h] = Offer(a["extTokens"], a["async"], past_hit=True)
        self.conn.lookups.pop(h, None)
        self.admission.counts.clear()
        freed = sorted(a["freed"])
        out = self.schedule([h, *freed], max(a["newTokens"], 1), first=h)
        self.conn.offers.pop(h, None)
        if out.num_scheduled_tokens or out.preempted_req_ids:
            raise Mismatch(
                f"schedule() scheduled {out.num_scheduled_tokens}, preempted "
                f"{sorted(out.preempted_req_ids)}; the model refuses {h} and "
                f"frees {freed}"
            )
        if self.admission.counts[:1] != [a["predictedBlocks"]]:
            raise Mismatch(
                f"get_num_blocks_to_allocate for {h}: vLLM {self.admission.counts}, "
                f"model {a['predictedBlocks']} (refused)"
            )

    def execute(self, before: dict, ev: dict) -> None:
        r = ev["req"]
        request = self.requests[r]
        st = before["step"][r]
        sampled = st["from"] + st["n"] == before["len"][r]
        accepted = ev["args"]["acceptedTokens"]
        tokens = [7000 + request.num_tokens + i for i in range(accepted + 1)]
        out = self.inflight.pop(r)
        self.sched.update_from_output(
            out, self.runner_output({r: tokens if sampled else []})
        )

    def finish_load(self, before: dict, after: dict, ev: dict) -> None:
        r = ev["req"]
        if r not in self.conn.pending:
            raise Mismatch(f"the connector has no load of {r} in flight")
        self.transfer_done(r)
        if ev["act"] == "FinishLoad" and before["status"][r] != "finishing":
            self.take_up_load(r)
            computed = self.requests[r].num_computed_tokens
            if computed != after["computed"][r]:
                # The request resumes after hit + external tokens (found by
                # this replay: 0.13.0 took every slot of the block tables).
                raise Mismatch(
                    f"{r}: num_computed_tokens {computed}, model "
                    f"{after['computed'][r]}; cached blocks "
                    f"{sorted(self.cached_real())}"
                )

    def invalid_blocks(self, before: dict, ev: dict) -> set[int]:
        """The real ids of the blocks the model's failed load leaves invalid:
        the load's blocks (async: the connector's pending load; sync: the
        external slots of the step) from table slot ``at`` on."""
        r, at = ev["req"], ev["args"]["atSlot"]
        step = before["step"][r]
        last = (
            (step["from"] - 1) // self.B + 1 if ev["act"] == "SyncLoadFailed" else 10**9
        )
        loading = {x[2] for x in before["loads"][r]} if before["loads"][r] else None
        return {
            self.m2r[m]
            for g in GROUPS
            for i, m in enumerate(before["table"][r][g], start=1)
            if m and at <= i <= last and (loading is None or m in loading)
        }

    def load_failed(self, before: dict, after: dict, ev: dict) -> None:
        """The async load fails from slot ``at`` on: the worker reports the
        invalid blocks with finished_recving; the scheduler truncates (or
        restarts) the request, and it is taken up as after any load."""
        r = ev["req"]
        if r not in self.conn.pending:
            raise Mismatch(f"the connector has no load of {r} in flight")
        self.transfer_done(r, self.invalid_blocks(before, ev))
        if before["status"][r] == "loading":
            self.take_up_load(r)
            computed = self.requests[r].num_computed_tokens
            if computed != after["computed"][r]:
                raise Mismatch(
                    f"{r} resumes at {computed} tokens after the load failure, "
                    f"model {after['computed'][r]}"
                )

    def sync_load_failed(self, before: dict, after: dict, ev: dict) -> None:
        """r's synchronous load failed: its step returns with the invalid
        blocks; the affected requests' outputs are dropped (the model's steps
        of the same batch)."""
        r, a = ev["req"], ev["args"]
        if r not in a["affected"]:
            raise Stop(STOP_SYNC_FAIL_UNAFFECTED, f"{r} at slot {a['atSlot']}")
        out = self.inflight.pop(r)
        step = before["step"][r]
        sampled = step["from"] + step["n"] == before["len"][r]
        tokens = [7000 + self.requests[r].num_tokens] if sampled else []
        self.sched.update_from_output(
            out,
            self.runner_output(
                {r: tokens}, invalid_block_ids=self.invalid_blocks(before, ev)
            ),
        )
        for q in a["affected"]:
            if q != r and before["step"][q]["on"]:
                self.inflight.pop(q, None)
        restarted = {q for q in a["restart"] if before["status"][q] == "running"}
        to_report = {
            r
            for r, record in self.sched.kv_connector_requests.items()
            if record.preempted_to_report
        }
        if not restarted <= to_report:
            raise Mismatch(
                f"the model preempts {sorted(restarted)} (they must start over "
                f"and lack blocks for it); the scheduler will report "
                f"{sorted(to_report)}"
            )

    def preempt(self, states: list[dict], k: int) -> int:
        """Preempt through schedule(): the preempting request's allocation
        fails and the scheduler preempts the last running request. Returns the
        index of the model state the scheduler reached."""
        before, after = states[k - 1], states[k]
        ev = after["event"]
        victim, by = ev["req"], ev["args"]["by"]
        # The model's ~Fits(by, 0, FALSE, 0): n new tokens, no draft.
        n = min(self.c["Chunk"], before["len"][by] - before["computed"][by])
        if victim == by:
            out = self.schedule([by], n)
            if out.preempted_req_ids != {by} or out.num_scheduled_tokens:
                raise Mismatch(
                    f"schedule(): scheduled {out.num_scheduled_tokens}, preempted "
                    f"{sorted(out.preempted_req_ids)}; model preempts {by}"
                )
            return k
        # schedule() retries `by` after preempting the victim in the same
        # call: the model's next step must be that retry.
        j = k + 1
        while j < len(states) and pc_only(states[j - 1], states[j]):
            j += 1
        nxt = states[j]["event"] if j < len(states) else None
        retried = nxt is not None and nxt["req"] == by
        retried = retried and (
            (nxt["act"] == "AllocateSlots" and nxt["args"]["draftTokens"] == 0)
            or (nxt["act"] == "Preempt" and nxt["args"]["by"] == by)
        )
        if not retried:
            raise Stop(STOP_PREEMPT_SPLIT, f"next event {nxt}")
        self.evicted.clear()
        out = self.schedule([by, victim], n)
        if victim not in out.preempted_req_ids:
            raise Mismatch(
                f"schedule(): preempted {sorted(out.preempted_req_ids)}, model "
                f"preempts {victim}"
            )
        if nxt["act"] == "Preempt":
            if out.preempted_req_ids != {victim, by}:
                raise Mismatch(
                    f"schedule(): preempted {sorted(out.preempted_req_ids)}, "
                    f"model preempts {victim} then {by}"
                )
        else:
            out.preempted_req_ids.discard(victim)
            self.check_allocation(states[j - 1], states[j], nxt, out)
        return j

    def step(self, states: list[dict], k: int) -> int:
        """Replay step k; returns the index of the model state reached."""
        before, after = states[k - 1], states[k]
        ev = after["event"]
        act = ev["act"]
        # A store starts when the step runs (Execute): the connector knows it
        # when the scheduler processes that step's output.
        self.mirror_saves(
            after if act in ("Execute", "Finish", "FinishDelayed") else before
        )
        if act == "AllocateSlots":
            out = self.allocate(before, ev, after)
            self.check_allocation(before, after, ev, out)
        elif act == "Refused":
            self.refused(before, ev)
        elif act == "SyncLoadFailed":
            self.sync_load_failed(before, after, ev)
        elif act in ("Execute", "Finish", "FinishDelayed"):
            self.execute(before, ev)
        elif act in ("FinishLoad", "FinishLoadFree"):
            self.finish_load(before, after, ev)
        elif act == "LoadFailed":
            self.load_failed(before, after, ev)
        elif act == "Preempt":
            return self.preempt(states, k)
        elif act in ("Abort", "AbortDelayed"):
            # The scheduler decides whether the blocks are freed now (Abort)
            # or when the load ends (AbortDelayed).
            self.sched.finish_requests(ev["req"], RequestStatus.FINISHED_ABORTED)
        elif act == "SaveDone":
            self.save_done(ev["req"])
        elif act == "FreeWaiting":
            self.free_waiting(before, after, ev)
        else:
            raise KeyError(act)
        return k

    # ---- abstraction ----
    def compare(self, state: dict) -> list[str]:
        problems = []
        for r in self.requests:
            problems += compare_table(
                r, self.real_tables(r), state["table"][r], self.r2m
            )
            status = self.real_status(r)
            if status != state["status"][r]:
                problems.append(
                    f"status {r}: model {state['status'][r]}, vLLM {status} "
                    f"({self.requests[r].status.name})"
                )
            load = self.conn.pending.get(r)
            loading = sorted(
                (self.r2m.get(x, f"?{x}") for x in load.all_block_ids())
                if load
                else (),
                key=str,
            )
            model_loading = sorted({x[2] for x in state["loads"][r]}, key=str)
            if loading != model_loading:
                problems.append(
                    f"loads {r}: model {model_loading}, connector's "
                    f"pending load {loading} as model ids"
                )
            held = sorted(
                self.r2m.get(b.block_id, f"?{b.block_id}")
                for b in self.sched.kv_cache_manager.held_blocks.get(r, [])
            )
            if held != sorted(state["held"][r]):
                problems.append(
                    f"held {r}: model {sorted(state['held'][r])}, vLLM {held}"
                )
            records = self.sched.kv_connector_requests
            if records.has_load_failed(r) != (r in state["noLoad"]):
                problems.append(
                    f"load_failed of {r}: {records.has_load_failed(r)}, "
                    f"model noLoad {sorted(state['noLoad'])}"
                )
            if records.is_recving(r) != bool(state["loads"][r]):
                problems.append(
                    f"recving of {r}: {records.is_recving(r)}, "
                    f"model loads {state['loads']}"
                )
            if state["status"][r] in ("waiting", "running"):
                request = self.requests[r]
                if request.num_computed_tokens != state["computed"][r]:
                    problems.append(
                        f"num_computed_tokens {r}: model {state['computed'][r]}, "
                        f"vLLM {request.num_computed_tokens}"
                    )
                if request.num_tokens != state["len"][r]:
                    problems.append(
                        f"num_tokens {r}: model {state['len'][r]}, "
                        f"vLLM {request.num_tokens}"
                    )
        running = [q.request_id for q in self.sched.running]
        if running != state["running"]:
            problems.append(f"running: model {state['running']}, vLLM {running}")
        waiting = sorted(q.request_id for q in self.sched.waiting)
        model_waiting = sorted(
            r for r, s in state["status"].items() if s in ("waiting", "loading")
        )
        if waiting != model_waiting:
            problems.append(f"waiting queue: model {model_waiting}, vLLM {waiting}")
        problems += compare_pool(self.pool, self.m2r, state, self.N)
        problems += self.compare_cache(state)
        return problems

    def compare_cache(self, state: dict) -> list[str]:
        """The prefix cache, block by block: the model and vLLM cache the same
        blocks (through the bijection; a key may name several blocks in both),
        and a block the model caches under key K is cached in vLLM under the
        hash that K stands for (one hash per key, one key per hash, learnt as
        they appear)."""
        problems = []
        real = self.cached_real()
        for m in range(1, self.N + 1):
            key = tuple(state["hash"][m - 1])
            x = self.m2r.get(m)
            h = real.get(x)
            if not key:
                if h is not None:
                    problems.append(f"vLLM caches block {x} (model {m}), the model not")
                continue
            if h is None:
                problems.append(f"model block {m} cached as {key}, vLLM {x} is not")
                continue
            if self.key2hash.setdefault(key, h) != h or (
                self.hash2key.setdefault(h, key) != key
            ):
                problems.append(
                    f"model block {m} cached as {key}, vLLM {x} under the hash of "
                    f"{self.hash2key[h]}"
                )
        for x in real:
            if x not in self.r2m:
                problems.append(f"vLLM caches block {x}, which the model never used")
        return problems

    def real_state(self) -> dict:
        return {
            "tables": {r: self.real_tables(r) for r in self.requests},
            "status": {r: self.requests[r].status.name for r in self.requests},
            "computed": {r: q.num_computed_tokens for r, q in self.requests.items()},
            "running": [q.request_id for q in self.sched.running],
            "waiting": [q.request_id for q in self.sched.waiting],
            "ref": {b.block_id: b.ref_cnt for b in self.pool.blocks[1:]},
            "free": [
                b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()
            ],
            "cached": sorted(self.cached_real()),
            "pending loads": {
                r: list(load.block_ids) for r, load in self.conn.pending.items()
            },
            "model->vLLM": dict(sorted(self.m2r.items())),
        }


def model_state(state: dict) -> dict:
    keys = (
        "event",
        "status",
        "running",
        "table",
        "ref",
        "freeQ",
        "hash",
        "computed",
        "len",
        "loads",
        "saves",
        "held",
        "noLoad",
    )
    return {k: state[k] for k in keys}


# ---------------------------------------------------------------------------
# Replay and summary.


def label(before: dict, ev: dict) -> str:
    """The kind of a step, for the summary."""
    act, a = ev["act"], ev["args"]
    if act == "AllocateSlots":
        kind = "async" if a["async"] else "sync-ext" if a["extTokens"] else ""
        kind += " draft" if a["draftTokens"] else ""
        if before["computed"][ev["req"]]:
            kind += f" {before['status'][ev['req']]}"
        return f"{act}({kind.strip()})" if kind else act
    if act == "Preempt":
        return f"{act}({'self' if a['by'] == ev['req'] else 'other'})"
    return act


@dataclass
class TraceResult:
    name: str
    steps: int = 0  # model steps replayed whose state was compared
    pc_only: int = 0
    events: int = 0  # steps with an event (not pc-only)
    acts: Counter = field(default_factory=Counter)  # compared steps by action
    seconds: float = 0.0
    diverged: str | None = None
    stop: tuple[str, int, str] | None = None  # cause, step, detail


def replay_trace(path: Path) -> TraceResult:
    """Replay one behaviour; raises Mismatch on the first difference."""
    start = time.perf_counter()
    doc = traces.read(path)
    states = doc.states
    res = TraceResult(path.name)
    res.events = sum(
        not pc_only(states[k - 1], states[k]) for k in range(1, len(states))
    )
    rp = Replay(doc.constants)
    k = 1
    while k < len(states):
        before, after = states[k - 1], states[k]
        if pc_only(before, after):
            res.pc_only += 1
            k += 1
            continue
        try:
            reached = rp.step(states, k)
            problems = rp.compare(states[reached])
        except Diverged as exc:
            res.diverged = f"step {k}: {exc}"
            break
        except Stop as exc:
            res.stop = (exc.args[0], k, exc.args[1] if len(exc.args) > 1 else "")
            break
        except Mismatch as exc:
            problems, reached = [str(exc)], k
        for i in range(k, reached + 1):
            if not pc_only(states[i - 1], states[i]):
                res.steps += 1
                res.acts[label(states[i - 1], states[i]["event"])] += 1
        if problems:
            raise Mismatch(
                f"{path.name} step {k}..{reached} ({states[reached]['event']}):\n  "
                + "\n  ".join(problems)
                + f"\nmodel before: {json.dumps(model_state(before))}"
                + f"\nmodel after:  {json.dumps(model_state(states[reached]))}"
                + f"\nvLLM after:   {json.dumps(rp.real_state())}"
            )
        k = reached + 1
    res.seconds = time.perf_counter() - start
    return res


@dataclass
class Summary:
    traces: int = 0
    complete: int = 0
    events: int = 0
    steps: int = 0
    pc_only: int = 0
    acts: Counter = field(default_factory=Counter)
    diverged: list[str] = field(default_factory=list)
    stops: Counter = field(default_factory=Counter)
    stopped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, res: TraceResult) -> None:
        self.traces += 1
        self.events += res.events
        self.steps += res.steps
        self.pc_only += res.pc_only
        self.acts.update(res.acts)
        self.seconds += res.seconds
        if res.diverged:
            self.diverged.append(f"{res.name} {res.diverged}")
        elif res.stop:
            cause, k, detail = res.stop
            self.stops[cause] += 1
            self.stopped.append(f"{res.name} step {k}: {cause} ({detail})")
        else:
            self.complete += 1

    def format(self) -> str:
        lines = [
            f"scheduler replay: {self.traces} traces, {self.complete} to the end, "
            f"{self.steps} of {self.events} steps compared "
            f"({self.pc_only} pc-only steps), {self.seconds:.2f} s of replay",
            "compared steps by action: "
            + ", ".join(f"{a} {n}" for a, n in sorted(self.acts.items())),
            f"diverged (eviction choice): {len(self.diverged)}",
            *(f"  {d}" for d in self.diverged),
            f"stopped by event: {sum(self.stops.values())}",
            *(f"  {n} x {cause}" for cause, n in self.stops.most_common()),
            *(f"  {s}" for s in self.stopped),
        ]
        return "\n".join(lines)


# Results of the traces replayed in this process, by file path.
RESULTS: dict[Path, TraceResult] = {}


def replay_all(paths: list[Path]) -> Summary:
    """Replay every trace (reusing results of this process); raises Mismatch.
    ``seconds`` sums the replay time of the traces (not the imports)."""
    summary = Summary()
    for path in paths:
        if path not in RESULTS:
            RESULTS[path] = replay_trace(path)
        summary.add(RESULTS[path])
    return summary


if __name__ == "__main__":
    # python scheduler_replay.py [DIR]: replay DIR's traces (or the
    # fixtures, or $HMASTACK_REPLAY_TRACES) and print the summary.
    if len(sys.argv) > 1:
        os.environ[TRACES_ENV] = sys.argv[1]
    print(replay_all(trace_paths()).format())
