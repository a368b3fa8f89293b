"""Stage 03: the harness of the stateful random test of the real `Scheduler`
(and `AsyncScheduler`) with a hybrid KV cache and a scripted KV connector:
the connectors, the `Harness` and its invariants (stage 03b's
`SchedulerMachine` drives it with hypothesis, stage 08's cross-stage machine
drives the series' connectors with it).

The harness drives `vllm.v1.core.sched.scheduler.Scheduler` or, with
`async_scheduling`, `AsyncScheduler` (the next step is scheduled before the
previous one's output is processed: steps in flight, output placeholders);
with `batch_queue`, the `Scheduler` with a batch queue of depth 2 (the
engine core's `step_with_batch_queue`, as with pipeline parallelism: steps
in flight without output placeholders).
The KVCacheConfig is built directly: Gemma-3-like (5 sliding window groups :
1 full attention group) or gpt-oss-like (one group of each; the explicit
tests also use Llama-like, one full attention group), with a scripted
`SupportsHMA` connector (`MachineConnector`); or Mistral-like (one sliding
window group) with a connector that does not support HMA
(`PlainMachineConnector`) or a `SupportsHMA` connector that declines it for
its configuration (`DecliningMachineConnector`): HMA is then off (the three
are `hmastack_testkit.scripted_connector`'s connectors with the checks of
`MachineChecks`). A small
pool, so that requests are refused, evicted and preempted; prefix caching on;
speculative decoding with draft tokens, with eagle-style lookahead slots or
without.

A request created with `save=True` is stored by the connector: the blocks
that become full in each of its steps (a store planned in
`build_connector_meta`, still reading them until reported, so the scheduler
must hold them when they leave the tables, see
`KVConnectorBase_V1.request_blocks_freed`), and all its blocks when it
finishes (a delayed free).

After every rule of the machine, and in the middle of each step (after
`schedule`, while the model runner would execute and sync loads write),
`Harness.check_all` checks the model's safety properties
(spec/HybridKVAlloc.tla) on the scheduler's real state: Conservation,
ExclusiveOwnership, NoTransferRace, RefCount, NullPrefix, WindowBound,
ExactAdmission, NoPrematurePublish; and one property per failure path of
stage 03 (issue "stage 03 failure paths"):

- `InvalidKVRead` (shared invalid blocks): no scheduled step reads KV that
  a load failed to write and that no step wrote since;
- `InFlightRead` (the in-flight fence): no block that a step in flight of a
  running request reads or writes is free;
- `InvalidOutput` (a failure reported after a later step): no token of a
  step that read invalid KV is appended or emitted;
- `InvalidHit` (a failure reported after its request's blocks were freed):
  once a load failure is reported, no block that a step computed on the
  invalid KV is in the prefix cache with the block hash it got then (a
  request preempted or aborted with the step in flight included);
- `ValidHit` (a failed load after a preemption or abort with its step in
  flight): once a load failure is reported, no prefix cache hit, in any
  group, is a block whose load failed and that no step wrote since, or a
  block a step computed on that KV (rules: `abort_load_in_flight`,
  `fail_sync_load`, and `steps` with `fail_left` fails the sync load of a
  request that no longer runs when its step returns);
- `FinishedTables` (what the connector gets at finish): the tables given to
  `request_finished` / `request_finished_all_groups` are the request's
  tables in the scheduler, which extend what `update_state_after_alloc`
  gave the connector and cover its computed tokens, or empty in every group
  when it holds no block (the connector then offers nothing: no delayed
  free);
- `StoreHold` (the hold for stores): every block a store still reads is
  allocated, in the request's table or held for it;
- `PlainConnectorBlocks` (connectors without HMA, or declining it): such a
  connector loads into real blocks only and gets `request_finished`, never
  `request_finished_all_groups`;
- `ResumeAfterLoad` (where an async load resumes): the resume point, and the
  external count after a failure, come from the loaded tokens;
- `ConnectorTables` (what `update_state_after_alloc` gets): the block ids of
  a request's calls since its last lookup, appended, are its block tables;
- `HoldPending` (holds keep the engine stepping): blocks kept for a request
  that neither waits nor runs make `has_requests()` True; with none, no
  request and no finished id to return, it is False;
- `MambaRejected` (Mamba groups): creating the connector with a Mamba group
  fails;
- `Progress` (the stall): nothing scheduled for STALL_STEPS steps while
  nothing runs, nothing is pending outside the scheduler and other waiting
  requests hold blocks the first one needs;
- `NoReload` (loads that fail again and again): a request that held a block
  whose load failed (its own load, at any block) starts no load again;
- `Recached` (recomputed blocks): every full block that a scheduled request
  has computed, or computes in the step, is in the prefix cache (after a
  load failure too, once the request computes the block again).
- `LiveRecords` (the connector side of a request): every entry of a
  per-request container of the scheduler belongs to a request it still has,
  in the state the container stands for; a finished request stays only while
  a delayed free or a load in flight keeps it; `num_in_flight_tokens` counts
  the steps in flight; held blocks, which may outlive the request, are read
  by a store the connector has not reported.
- `EvictionOrder` (held blocks keep the eviction order,
  `hmastack_testkit.eviction_order`):
  the held blocks a `finished_sending` report releases enter the free block
  queue one after the other, in the order in which they left the block
  tables for the last time (the order of an immediate free).

Stage 03b's tests (`patches/03b-connector-requests/tests/`):
`machine_rules.py` holds the machine's rules (`SchedulerMachine`),
`test_scheduler_state_machine.py` runs it (and `test_coverage`);
the `test_machine_*.py` files hold shrunk schedules as explicit tests, one
file per family of properties: `test_machine_holds.py` (blocks kept while a
connector reads or writes them), `test_machine_external_tokens.py` (the
blocks and tables of external tokens, where a load resumes),
`test_machine_load_failures.py` (failed loads and their recovery),
`test_machine_aborts_in_flight.py` and
`test_machine_preemption_in_flight.py` (a request that leaves the running
requests while a step that loads or computes on a load is in flight).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import event
from hypothesis.control import _current_build_context
from vllm.config import (
    KVTransferConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from hmastack_testkit import kvtest
from hmastack_testkit import scripted_connector as scripted
from hmastack_testkit.eviction_order import EvictionOrder
from hmastack_testkit.kvtest import (
    make_cpu_vllm_config,
    make_kv_cache_groups,
    model_runner_output,
)
from hmastack_testkit.scripted_connector import Load, Offer

BLOCK_SIZE = 16
EOS = 2
MAX_MODEL_LEN = 2048
LAYOUTS = {
    "gemma3_like": ["sliding_window"] * 5 + ["full"],
    "gpt_oss_like": ["full", "sliding_window"],
    # One full attention group: a load failure past block 0 is computed again
    # from there (no null block to start over for). Explicit tests only.
    "llama_like": ["full"],
    # One sliding window group: HMA off, a connector without SupportsHMA.
    "mistral_like": ["sliding_window"],
    # The same with a SupportsHMA connector that declines HMA.
    "mistral_like_declined": ["sliding_window"],
}
PLAIN_LAYOUTS = {"mistral_like", "mistral_like_declined"}
# Shared prompt prefixes (in blocks): requests that pick the same one hit
# each other's cached blocks.
PREFIX_BLOCKS = (0, 2, 5, 9)
# Consecutive steps that schedule and finish nothing, with nothing pending
# outside the scheduler, that count as a stall.
STALL_STEPS = 3


# What the state machine's examples exercised (see test_coverage of
# test_scheduler_state_machine.py; the explicit tests are not counted).
COVERAGE: Counter[str] = Counter()


def _note(what: str) -> None:
    if _current_build_context.value is not None:  # inside a hypothesis test
        COVERAGE[what] += 1
        event(what)


# -- the connector ------------------------------------------------------------


def connector_state(scheduler: Scheduler, name: str) -> dict[str, Any]:
    """The connector side of the scheduler's requests, one field of their
    records (`KVConnectorRequest`): each request whose record has it set,
    with its value."""
    return {
        req_id: getattr(record, name)
        for req_id, record in scheduler.kv_connector_requests.items()
        if getattr(record, name)
    }


class MachineChecks:
    """The state machine's checks on the scripted connector
    (`hmastack_testkit.scripted_connector`), mixed into each of its classes.

    The script: `offers[req_id]` (the KV of the first tokens of a request,
    loaded synchronously or asynchronously; an async load may cover the
    prompt, as P/D's does) and `save_req_ids`. For a request of
    `save_req_ids`, each step's `build_connector_meta` plans a store of the
    blocks that become full in that step (`stores`, read until the state
    machine reports the request in `finished_sending`), and a finished
    request's blocks are held until then (`saving`).

    Checked on every call: `ConnectorTables` (`table_violations`), `NoReload`
    (`reload_violations`), `FinishedTables` (`finish_violations`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler: Scheduler | None = None  # set by the harness
        # req_id -> local hit + external tokens of its last async load.
        self.async_load_end: dict[str, int] = {}
        # req_id -> local hit tokens before its last async load.
        self.async_load_start: dict[str, int] = {}
        self.table_violations: list[str] = []
        # Requests that held a block whose load of theirs failed (NoReload),
        # and the loads started for them afterwards.
        self.load_failed: set[str] = set()
        self.reload_violations: list[str] = []
        # FinishedTables: what the connector was given at finish that is not
        # the blocks holding the request's computed KV.
        self.finish_violations: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        # A new lookup (a new request, or one that starts over): an earlier
        # load's end no longer bounds what the request resumes with.
        self.async_load_end.pop(request.request_id, None)
        self.async_load_start.pop(request.request_id, None)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req_id = request.request_id
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._check_tables(req_id)
        if num_external_tokens == 0:
            return
        if req_id in self.load_failed:
            self.reload_violations.append(
                f"{req_id} loads {num_external_tokens} external tokens again "
                "after a load of them failed"
            )
        load = self.pending.get(req_id)
        if load is not None and load.load_async:
            self.async_load_end[req_id] = load.end
            self.async_load_start[req_id] = load.start

    def _check_tables(self, req_id: str) -> None:
        """ConnectorTables: the block ids of the calls since the last lookup,
        appended, are the scheduler's tables (where the scheduler has not
        replaced a block by the null block since): each call got only the
        blocks appended to the tables
        (`KVConnectorBase_V1.update_state_after_alloc`)."""
        assert self.scheduler is not None
        kept = self.block_tables[req_id]
        manager = self.scheduler.kv_cache_manager
        null_block_id = manager.block_pool.null_block.block_id
        tables = manager.get_block_ids(req_id)
        if len(kept) != len(tables) or any(
            len(k) != len(t)
            or any(a != b for a, b in zip(k, t, strict=True) if b != null_block_id)
            for k, t in zip(kept, tables, strict=True)
        ):
            self.table_violations.append(
                f"{req_id}: connector's tables {kept}, scheduler's {list(tables)}"
            )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.scheduler is not None
        manager = self.scheduler.kv_cache_manager
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if req_id not in self.save_req_ids:
                continue
            request = self.scheduler.requests[req_id]
            # Not advanced yet: the step computes [start, start + n).
            start = request.num_computed_tokens
            end = min(start + n, request.num_tokens)
            blocks = {
                b.block_id
                for group in manager.get_blocks(req_id).blocks
                for b in group[start // BLOCK_SIZE : end // BLOCK_SIZE]
                if not b.is_null
            }
            if blocks:
                self.stores.setdefault(req_id, set()).update(blocks)
                _note("store planned")
        return super().build_connector_meta(scheduler_output)

    def _blocks_freed(self, request_id: str, block_ids: list[int]) -> set[int]:
        held = super()._blocks_freed(request_id, block_ids)
        if held:
            _note("blocks held for a store")
        return held

    def _finished(self, request: Request, block_ids: tuple[list[int], ...]):
        self._check_finished_tables(request, block_ids)
        if not any(block_ids):
            # The request holds no block: its KV is in no block, there is
            # nothing to save (`KVConnectorBase_V1.request_finished`).
            if request.request_id in self.save_req_ids:
                _note("finished holding no block")
            return False, None
        return super()._finished(request, block_ids)

    def _check_finished_tables(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> None:
        """FinishedTables: the tables given at finish are the blocks that
        hold the request's computed KV: its tables in the scheduler, which
        extend what `update_state_after_alloc` gave the connector since the
        last lookup (a block the window slid past may be the null block
        now) and cover its computed tokens; empty in every group when the
        request holds no block."""
        assert self.scheduler is not None
        req_id = request.request_id
        manager = self.scheduler.kv_cache_manager
        null_block_id = manager.block_pool.null_block.block_id
        tables = [list(t) for t in manager.get_block_ids(req_id)]
        given = [list(t) for t in block_ids]
        if given != tables[: len(given)] or len(given) not in (1, len(tables)):
            self.finish_violations.append(
                f"{req_id} finished with tables {given}; it holds {tables}"
            )
            return
        if not any(given):
            return
        kept = self.block_tables.get(req_id, [])
        num_computed = cdiv(
            min(request.num_computed_tokens, request.num_tokens), BLOCK_SIZE
        )
        for group, table in enumerate(given):
            old = kept[group] if group < len(kept) else []
            if len(table) < max(len(old), num_computed) or any(
                b != k and b != null_block_id for b, k in zip(table, old, strict=False)
            ):
                self.finish_violations.append(
                    f"{req_id} finished with table {table} (group {group}): the "
                    f"connector got {old}, {num_computed} blocks are computed"
                )
                return


class MachineConnector(MachineChecks, scripted.HoldingScriptedConnector):
    """`SupportsHMA`: every KV cache group."""


class PlainMachineConnector(MachineChecks, scripted.PlainScriptedConnector):
    """The same script, for a connector that does not support HMA."""


class DecliningMachineConnector(MachineChecks, scripted.DecliningScriptedConnector):
    """The same script, for a `SupportsHMA` connector that declines HMA for
    its configuration: it must be treated as one without HMA support
    (`PlainConnectorBlocks`)."""

    def request_finished_all_groups(self, request, block_ids):
        raise AssertionError(
            "PlainConnectorBlocks violated: a connector that declined HMA got "
            "request_finished_all_groups"
        )


CONNECTOR_NAMES = {
    MachineConnector: "HmastackScriptedConnector",
    PlainMachineConnector: "HmastackPlainScriptedConnector",
    DecliningMachineConnector: "HmastackDecliningScriptedConnector",
}


def connector_class(setup: Setup) -> type:
    if setup.layout == "mistral_like_declined":
        return DecliningMachineConnector
    return PlainMachineConnector if setup.plain else MachineConnector


for _cls, _name in CONNECTOR_NAMES.items():
    if _name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(_name, __name__, _cls.__name__)

# -- the scheduler ------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    layout: str
    window: int
    num_blocks: int
    num_spec_tokens: int  # 0: no speculative decoding
    eagle: bool  # lookahead slots for the drafts
    max_num_batched_tokens: int
    fail_policy: str  # kv_load_failure_policy
    async_scheduling: bool = False
    # Synchronous scheduling with a batch queue of depth 2 (the engine core's
    # step_with_batch_queue, as with pipeline parallelism): the next step is
    # scheduled before the previous one's output is processed, without output
    # placeholders. Without speculative decoding.
    batch_queue: bool = False

    @property
    def plain(self) -> bool:
        return self.layout in PLAIN_LAYOUTS

    @property
    def steps_in_flight(self) -> bool:
        """A step is in flight while the next one is scheduled."""
        return self.async_scheduling or self.batch_queue


def machine_vllm_config(setup: Setup, connector_cls: type) -> VllmConfig:
    vllm_config = make_cpu_vllm_config(
        BLOCK_SIZE,
        setup.num_blocks,
        KVTransferConfig(
            kv_connector=CONNECTOR_NAMES[connector_cls],
            kv_role="kv_both",
            kv_load_failure_policy=setup.fail_policy,
        ),
        max_num_seqs=4,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
    )
    if setup.num_spec_tokens:
        vllm_config.speculative_config = speculative_config(
            setup.num_spec_tokens, setup.eagle
        )
    return vllm_config


def speculative_config(num_spec_tokens: int, eagle: bool) -> SpeculativeConfig:
    """Speculative decoding with `num_spec_tokens` draft tokens, ngram's or,
    with `eagle`, EAGLE's (lookahead slots for the drafts)."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens)
    if eagle:
        # The scheduler only asks use_eagle() (lookahead slots for the
        # drafts); an eagle draft model cannot be built on CPU.
        object.__setattr__(config, "method", "eagle")
    return config


def machine_scheduler(setup: Setup) -> Scheduler:
    groups = make_kv_cache_groups(LAYOUTS[setup.layout], BLOCK_SIZE, setup.window)
    connector_cls = connector_class(setup)
    vllm_config = machine_vllm_config(setup, connector_cls)
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is (setup.plain)
    scheduler = kvtest.make_scheduler(
        vllm_config,
        KVCacheConfig(
            num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        ),
        scheduler_cls=AsyncScheduler if setup.async_scheduling else Scheduler,
    )
    assert type(scheduler.connector) is connector_cls
    assert not setup.batch_queue or not (
        setup.async_scheduling or setup.num_spec_tokens
    )
    assert scheduler.use_eagle == (setup.num_spec_tokens > 0 and setup.eagle)
    scheduler.connector.scheduler = scheduler
    return scheduler


def make_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return kvtest.make_request(req_id, prompt, BLOCK_SIZE, max_tokens, EOS)


def make_prompt(prefix: int, num_own: int, serial: int) -> list[int]:
    """A prompt: the shared prefix `prefix` (of `PREFIX_BLOCKS`), then
    `num_own` tokens of the prompt numbered `serial`."""
    prompt = [1000 + 7 * i + prefix for i in range(PREFIX_BLOCKS[prefix] * BLOCK_SIZE)]
    return prompt + [3000 + 100 * serial + i for i in range(num_own)]


@dataclass
class Step:
    """A scheduled step whose output the fake model runner has not returned."""

    output: SchedulerOutput
    # req_id -> draft tokens scheduled, for the requests that sample.
    samples: dict[str, int]
    sync_loads: dict[str, Load]
    # req_id -> blocks the step reads (KV before the request's first token of
    # the step, within its window) or writes (its tokens, its sync load).
    reads: dict[str, set[int]]
    writes: dict[str, set[int]]
    # (block_id, offset) of every token the step writes.
    written: set[tuple[int, int]]
    accept: int
    eos_pick: int | None
    fail_sync: int | None
    # The request whose sync load fails (with fail_sync), else one picked by
    # fail_sync.
    fail_req: str | None = None
    # Requests whose output of this step is computed on invalid KV.
    tainted: set[str] = field(default_factory=set)
    # req_id -> block_id -> block hash at schedule of the blocks the step
    # computes tokens into (not its loads) (InvalidHit).
    computed: dict[str, dict[int, object]] = field(default_factory=dict)


class Harness:
    """The scheduler, its connector, a fake model runner, and the checks."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.kinds = LAYOUTS[setup.layout]
        self.scheduler = machine_scheduler(setup)
        self.connector: MachineChecks = self.scheduler.connector  # type: ignore
        # EvictionOrder: observes the frees and the releases of held blocks.
        self.eviction_order = EvictionOrder(self.scheduler)
        self._observe()
        # Stores reported with the next model runner output.
        self.finished_sending: set[str] = set()
        # req_id -> fail_sync of the sync load of its that fails when the step
        # that loads it returns (`fail_sync_load`).
        self.fail_load_of: dict[str, int] = {}
        # Requests a step loaded synchronously.
        self.sync_loaded: set[str] = set()
        _note("example")

    def _observe(self) -> None:
        """The state of the fake model runner and of the checks over
        `scheduler`, and the wrappers of the scheduler's calls that the
        checks measure (`setup`, `kinds`, `scheduler` and `connector` are
        set first)."""
        self.windows = [
            self.setup.window if kind == "sliding_window" else None
            for kind in self.kinds
        ]
        self.manager = self.scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.next_id = 0
        # Loads reported with the next model runner output.
        self.finished_recving: set[str] = set()
        self.invalid_block_ids: set[int] = set()
        # req_id -> tokens (in flight + lookahead) of its last allocation.
        self.last_allocated: dict[str, int] = {}
        self.admissions: list[tuple[int, int, int | None]] = []
        self.in_flight: deque[Step] = deque()
        # block_id -> offsets whose KV a load failed to write and that no
        # step wrote since (InvalidKVRead).
        self.invalid_slots: dict[int, set[int]] = {}
        # Blocks that evict_blocks took out of the prefix cache since they
        # were last allocated (ExclusiveOwnership).
        self.evicted: set[int] = set()
        self.violations: list[str] = []
        # ValidHit: the prefix cache hits of the current schedule (req_id,
        # block ids per group), and block_id -> the block hash of a block a
        # step computed on KV that failed to load, until it leaves the cache.
        self.hits: list[tuple[str, list[list[int]]]] = []
        self.computed_on_failed: dict[int, object] = {}
        self.idle_steps = 0
        self.noted: set[str] = set()
        # req_id -> (prompt, max_tokens) of every request added (add_again).
        self.prompts: dict[str, tuple[list[int], int]] = {}
        # While the step that loads this request's external tokens
        # synchronously is in flight and the request runs, the pool is short
        # of blocks for every running request's allocation that takes any:
        # the scheduler preempts for memory (`preempt_for_memory`).
        self.short_of_blocks_for: str | None = None
        self._wrap_allocate_slots()

    # -- ExactAdmission: measure every allocate_slots of the scheduler.
    def _wrap_allocate_slots(self) -> None:
        manager, coordinator, pool = self.manager, self.manager.coordinator, self.pool
        allocate_slots = manager.allocate_slots
        get_num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate
        seen: list[tuple[int, int]] = []

        def counted(*args, **kwargs):
            predicted = get_num_blocks_to_allocate(*args, **kwargs)
            free = pool.get_num_free_blocks()
            if predicted and self._pool_short(kwargs["request_id"]):
                # allocate_slots refuses, as with `free` blocks fewer.
                _note("pool short of blocks")
                return free + 1
            seen.append((predicted, free))
            return predicted

        def measured(*args, **kwargs):
            seen.clear()
            new_blocks = allocate_slots(*args, **kwargs)
            if seen:
                ((predicted, free_before),) = seen
                free_after = None if new_blocks is None else pool.get_num_free_blocks()
                self.admissions.append((predicted, free_before, free_after))
            return new_blocks

        get_computed_blocks = manager.get_computed_blocks

        def hits(request):
            blocks, num_hit_tokens = get_computed_blocks(request)
            if num_hit_tokens:
                _note("local prefix cache hit")
                self.hits.append((request.request_id, list(blocks.get_block_ids())))
            return blocks, num_hit_tokens

        coordinator.get_num_blocks_to_allocate = counted
        manager.allocate_slots = measured
        manager.get_computed_blocks = hits

        # -- ExclusiveOwnership: the blocks evict_blocks took out of the cache.
        evict_blocks, get_new_blocks = pool.evict_blocks, pool.get_new_blocks

        def evicting(block_ids):
            self.evicted.update(
                b for b in block_ids if pool.blocks[b].block_hash is not None
            )
            evict_blocks(block_ids)
            for b in block_ids:
                self.computed_on_failed.pop(b, None)

        def allocating(num_blocks):
            blocks = get_new_blocks(num_blocks)
            self.evicted.difference_update(b.block_id for b in blocks)
            for b in blocks:
                self.computed_on_failed.pop(b.block_id, None)
            return blocks

        pool.evict_blocks = evicting
        pool.get_new_blocks = allocating

    def _pool_short(self, req_id: str) -> bool:
        """The pool is short of blocks for a running request's allocation
        while the step that loads `short_of_blocks_for` synchronously is in
        flight and that request runs."""
        target = self.short_of_blocks_for
        return (
            target is not None
            and self.running(req_id)
            and self._pool_short_possible(target)
        )

    # -- actions
    def add_request(
        self,
        prefix: int,
        num_own: int,
        num_external: int,
        load_async: bool,
        max_tokens: int,
        save: bool,
    ) -> str:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        prompt = make_prompt(prefix, num_own, self.next_id)
        if num_external:
            self.connector.offers[req_id] = Offer(
                num_external, load_async, whole_prompt=True
            )
        if save:
            self.connector.save_req_ids.add(req_id)
        self.prompts[req_id] = (prompt, max_tokens)
        self.scheduler.add_request(make_request(req_id, prompt, max_tokens))
        return req_id

    def add_again(self, req_id: str) -> str:
        """A new request with the prompt of `req_id` (and the same external
        tokens, stored or not): it hits what `req_id` left in the prefix
        cache."""
        again = f"r{self.next_id}"
        self.next_id += 1
        prompt, max_tokens = self.prompts[req_id]
        connector = self.connector
        if req_id in connector.offers:
            connector.offers[again] = connector.offers[req_id]
        if req_id in connector.save_req_ids:
            connector.save_req_ids.add(again)
        self.prompts[again] = (prompt, max_tokens)
        self.scheduler.add_request(make_request(again, list(prompt), max_tokens))
        _note("prompt sent again")
        return again

    def step(
        self,
        accept: int,
        eos_pick: int | None,
        fail_sync: int | None,
        fail_left: int | None = None,
    ) -> None:
        """Schedule one step; process the output of the oldest step in flight
        (the same one without asynchronous scheduling). With `fail_left`, the
        sync load of that step of a request that no longer runs (preempted for
        memory by this schedule, or aborted since) fails, if it has one."""
        scheduler, connector = self.scheduler, self.connector
        connector.sync_loads = {}
        num_preempted = sum(r.num_preemptions for r in scheduler.requests.values())
        num_waiting_for_load = len(connector.pending)
        self.hits.clear()
        output = scheduler.schedule()
        if sum(r.num_preemptions for r in scheduler.requests.values()) > num_preempted:
            _note("preemption")
        if len(connector.pending) > num_waiting_for_load:
            _note("async load started")
        if connector.sync_loads:
            _note("sync load")
            self.sync_loaded.update(connector.sync_loads)
        if output.scheduled_spec_decode_tokens:
            _note("drafts scheduled")
        if self.in_flight:
            _note("scheduled with a step in flight")
        step = self._new_step(output, accept, eos_pick, fail_sync)
        self._read_and_write(step)
        self.check_valid_hits()
        self.check_recached(output)
        self.in_flight.append(step)
        # The model runner executes the step: sync loads write now.
        self.check_all()
        num_unfinished = scheduler.get_num_unfinished_requests()
        if not self.setup.steps_in_flight or len(self.in_flight) > 1:
            oldest = self.in_flight[0]
            left = [r for r in sorted(oldest.sync_loads) if not self.running(r)]
            if fail_left is not None and left:
                oldest.fail_req = left[fail_left % len(left)]
                oldest.fail_sync = fail_left
            self._process(self.in_flight.popleft())
        self.check_progress(
            bool(output.total_num_scheduled_tokens)
            or scheduler.get_num_unfinished_requests() < num_unfinished
        )

    def _new_step(
        self,
        output: SchedulerOutput,
        accept: int,
        eos_pick: int | None,
        fail_sync: int | None,
    ) -> Step:
        """The step `schedule` returned `output` for, and the tokens of each
        request's allocation in it (WindowBound)."""
        scheduler = self.scheduler
        for req_id in output.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            self.last_allocated[req_id] = (
                request.num_in_flight_tokens + scheduler.num_lookahead_tokens
            )
        for req_id in self.connector.pending:
            self.last_allocated.setdefault(req_id, 0)
        return Step(
            output,
            {
                req_id: len(output.scheduled_spec_decode_tokens.get(req_id, ()))
                for req_id in output.num_scheduled_tokens
                if scheduler.requests[req_id].num_computed_tokens
                >= scheduler.requests[req_id].num_tokens
            },
            dict(self.connector.sync_loads),
            {},
            {},
            set(),
            accept,
            eos_pick,
            fail_sync,
        )

    def drain(self) -> None:
        """Process the outputs of the steps still in flight."""
        while self.in_flight:
            self._process(self.in_flight.popleft())

    def _positions(self, req_id: str, group: int, start: int, end: int):
        """(block_id, offset) of the real blocks holding tokens [start, end) in
        one group of the request's table."""
        table = self.manager.coordinator.single_type_managers[group].req_to_blocks.get(
            req_id, []
        )
        for pos in range(start, end):
            index = pos // BLOCK_SIZE
            if index < len(table) and not table[index].is_null:
                yield table[index].block_id, pos % BLOCK_SIZE

    def _read_and_write(self, step: Step) -> None:
        """What the step writes (sync loads, its tokens) and reads (the window
        before each request's first token), in the order the model runner
        does it; a read of KV that is invalid and not written is a violation
        (InvalidKVRead)."""
        for req_id, load in step.sync_loads.items():
            for group in range(len(self.kinds)):
                for block_id, offset in self._positions(
                    req_id, group, load.start, load.end
                ):
                    self._write(block_id, offset)
                    step.writes.setdefault(req_id, set()).add(block_id)
                    step.written.add((block_id, offset))
        starts = {}
        for req_id, n in step.output.num_scheduled_tokens.items():
            end = self.scheduler.requests[req_id].num_computed_tokens
            starts[req_id] = end - n
            for group in range(len(self.kinds)):
                for block_id, offset in self._positions(req_id, group, end - n, end):
                    self._write(block_id, offset)
                    step.writes.setdefault(req_id, set()).add(block_id)
                    step.written.add((block_id, offset))
                    step.computed.setdefault(req_id, {})[block_id] = self.pool.blocks[
                        block_id
                    ].block_hash
        for req_id, start in starts.items():
            read = step.reads.setdefault(req_id, set())
            for group in range(len(self.kinds)):
                first = self._first_read(group, start)
                for block_id, offset in self._positions(req_id, group, first, start):
                    read.add(block_id)
                    if offset in self.invalid_slots.get(block_id, ()):
                        self.violations.append(
                            f"InvalidKVRead violated: {req_id} reads token "
                            f"{offset} of block {block_id} (group {group}) whose "
                            "load failed and that no step computed since"
                        )

    def _first_read(self, group: int, start: int) -> int:
        """The first token whose KV the layers of `group` read for a token
        at `start` (its window)."""
        window = self.windows[group]
        return 0 if window is None else max(0, start - window + 1)

    def _write(self, block_id: int, offset: int) -> None:
        offsets = self.invalid_slots.get(block_id)
        if offsets is not None:
            offsets.discard(offset)
            if not offsets:
                del self.invalid_slots[block_id]

    def note_once(self, what: str) -> None:
        """Note `what` once per example (a count of examples)."""
        if what not in self.noted:
            self.noted.add(what)
            _note(what)

    def _process(self, step: Step) -> None:
        """The model runner returns `step`'s output."""
        scheduler, connector = self.scheduler, self.connector
        invalid = set(self.invalid_block_ids)
        for req_id in sorted(step.sync_loads) if step.fail_req is None else ():
            if req_id in self.fail_load_of:
                step.fail_req = req_id
                step.fail_sync = self.fail_load_of.pop(req_id)
                break
        if step.fail_sync is not None and step.sync_loads:
            loads = sorted(step.sync_loads.items())
            req_id, load = loads[step.fail_sync % len(loads)]
            if step.fail_req is not None:
                req_id, load = step.fail_req, step.sync_loads[step.fail_req]
            groups = [g for g in load.block_ids if g]
            if groups:
                group = groups[step.fail_sync % len(groups)]
                invalid |= set(group[(step.fail_sync // 7) % len(group) :])
                _note("sync load failed")
                if not self.running(req_id):
                    request = scheduler.requests.get(req_id)
                    self.note_once(
                        "sync load failed after its request was preempted"
                        if request is not None and not request.is_finished()
                        else "sync load failed after its request finished"
                    )
                if any(self.pool.blocks[b].ref_cnt > 1 for b in invalid):
                    _note("load failure on a shared block")
        if invalid:
            tables = self.tables()
            failed_loads = [
                (req_id, load)
                for req_id, load in step.sync_loads.items()
                if self.running(req_id)
            ] + [
                (req_id, connector.pending[req_id]) for req_id in self.finished_recving
            ]
            for req_id, load in failed_loads:
                own = {b.block_id for g in tables.get(req_id, []) for b in g}
                if load.all_block_ids() & invalid & own:
                    connector.load_failed.add(req_id)
            self._invalidate(invalid)
            # This step and the later ones in flight computed on that KV.
            for s in (step, *self.in_flight):
                for req_id, blocks in s.reads.items():
                    if blocks & invalid:
                        s.tainted.add(req_id)
                        if s is not step:
                            _note("load failure reported after a later step")
        # Async loads reported now wrote their blocks (except failed ones).
        for req_id in self.finished_recving:
            self._write_load(req_id, connector.pending[req_id], invalid)

        req_ids, sampled = self._sample(step)
        model_runner_output = self._model_runner_output(
            req_ids, sampled, self.finished_sending, self.finished_recving, invalid
        )
        for req_id in self.finished_recving:
            connector.pending.pop(req_id, None)
        for req_id in self.finished_sending:
            connector.saving.pop(req_id, None)
        self.finished_recving.clear()
        self.finished_sending.clear()
        self.invalid_block_ids.clear()
        # Blocks computed on the invalid KV (this step's and the later ones'
        # in flight), with the block hash they had when they were computed;
        # not a block that a step scheduled after that one writes whole again
        # (freed and allocated again meanwhile): steps run in order, so the
        # block holds what the later step writes.
        steps = (step, *self.in_flight)
        computed_on_invalid = [
            (r, block_id, block_hash)
            for i, s in enumerate(steps)
            for r in s.tainted
            for block_id, block_hash in s.computed.get(r, {}).items()
            if block_hash is not None
            and not any(
                all((block_id, offset) in later.written for offset in range(BLOCK_SIZE))
                for later in steps[i + 1 :]
            )
        ]
        # A request finished before this output (aborted, its blocks kept for
        # a delayed free) has no client any more: its tokens reach nobody.
        step.tainted = {
            r
            for r in step.tainted
            if r in scheduler.requests and not scheduler.requests[r].is_finished()
        }
        num_output_tokens = {
            r: scheduler.requests[r].num_output_tokens for r in step.tainted
        }
        # ValidHit: until they leave the prefix cache (evicted, or allocated
        # again).
        for _, block_id, block_hash in computed_on_invalid:
            self.computed_on_failed[block_id] = block_hash
        engine_outputs = scheduler.update_from_output(step.output, model_runner_output)
        for r, block_id, block_hash in computed_on_invalid:
            if self.pool.blocks[block_id].block_hash == block_hash:
                self.violations.append(
                    f"InvalidHit violated: block {block_id} that {r} computed on "
                    "KV that failed to load is still in the prefix cache"
                )
                break
        emitted = {
            output.request_id
            for outputs in engine_outputs.values()
            for output in outputs.outputs
            if output.new_token_ids
        }
        for req_id in step.tainted:
            request = scheduler.requests.get(req_id)
            if req_id in emitted or (
                request is not None
                and request.num_output_tokens > num_output_tokens.get(req_id, 0)
            ):
                self.violations.append(
                    f"InvalidOutput violated: a token of {req_id} computed on KV "
                    "that failed to load was appended or emitted"
                )
        if step.output.scheduled_cached_reqs.resumed_req_ids:
            _note("preempted request resumed")
        if any(
            r not in scheduler.requests or scheduler.requests[r].is_finished()
            for r in req_ids
        ):
            _note("request finished")
        self._propose_drafts(req_ids, sampled)

    def _invalidate(self, invalid: set[int]) -> None:
        """A load failed to write the blocks `invalid`: none of their KV is
        valid, but what the steps in flight write (scheduled later, they run
        later) stays."""
        for block_id in invalid:
            self.invalid_slots[block_id] = set(range(BLOCK_SIZE))
        for later in self.in_flight:
            for block_id, offset in later.written:
                if block_id in invalid:
                    self._write(block_id, offset)

    def _write_load(self, req_id: str, load: Load, invalid: set[int]) -> None:
        """A load of `req_id` reported done wrote its blocks, except the
        blocks `invalid`."""
        for group in range(len(self.kinds)):
            for block_id, offset in self._positions(
                req_id, group, load.start, load.end
            ):
                if block_id not in invalid:
                    self._write(block_id, offset)

    def _sample(self, step: Step) -> tuple[list[str], list[list[int]]]:
        """The requests of `step` and the tokens the fake model runner samples
        for each: none for a chunk of the prompt, else one token and the
        draft tokens it accepts (`accept`), EOS last for the request
        `eos_pick` picks."""
        req_ids = list(step.output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for i, req_id in enumerate(req_ids):
            if req_id not in step.samples:
                sampled.append([])  # a chunk of the prompt
                continue
            n = 1 + min(step.accept, step.samples[req_id])
            tokens = [500 + (i + j) % 50 for j in range(n)]
            if step.eos_pick is not None and step.eos_pick % len(req_ids) == i:
                tokens[-1] = EOS
            sampled.append(tokens)
        return req_ids, sampled

    @staticmethod
    def _model_runner_output(
        req_ids: list[str],
        sampled: list[list[int]],
        sending: set[str],
        recving: set[str],
        invalid: set[int],
    ) -> ModelRunnerOutput:
        """The model runner's output: the tokens sampled and what the worker
        side of the connector reports (stores and loads done, the blocks of
        failed loads)."""
        has_kv_output = bool(sending or recving or invalid)
        return model_runner_output(
            req_ids,
            sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=set(sending) or None,
                finished_recving=set(recving) or None,
                invalid_block_ids=set(invalid),
            )
            if has_kv_output
            else None,
        )

    def _propose_drafts(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The drafter proposes for every request that sampled (with async
        scheduling the worker fills the scheduler's placeholders)."""
        scheduler = self.scheduler
        if scheduler.num_spec_tokens and not self.setup.async_scheduling:
            draft_req_ids = [
                r
                for r, tokens in zip(req_ids, sampled, strict=True)
                if tokens and r in scheduler.requests
            ]
            scheduler.update_draft_token_ids(
                DraftTokenIds(
                    draft_req_ids,
                    [[600 + j for j in range(scheduler.num_spec_tokens)]]
                    * len(draft_req_ids),
                )
            )

    def loads_to_report(self) -> list[str]:
        return sorted(set(self.connector.pending) - self.finished_recving)

    def finish_load(self, pick: int) -> None:
        loads = self.loads_to_report()
        self.finished_recving.add(loads[pick % len(loads)])
        _note("async load finished")

    def fail_load(self, pick: int, group_pick: int, first: int) -> None:
        loads = self.loads_to_report()
        req_id = loads[pick % len(loads)]
        groups = [g for g in self.connector.pending[req_id].block_ids if g]
        if groups:
            group = groups[group_pick % len(groups)]
            self.invalid_block_ids |= set(group[first % len(group) :])
            _note("async load failed")
            if any(self.pool.blocks[b].ref_cnt > 1 for b in self.invalid_block_ids):
                _note("load failure on a shared block")
        self.finished_recving.add(req_id)

    def abort(self, pick: int) -> None:
        live = sorted(
            r for r, req in self.scheduler.requests.items() if not req.is_finished()
        )
        req_id = live[pick % len(live)]
        if req_id in self.connector.pending:
            _note("abort during async load")
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def loads_in_flight(self) -> list[str]:
        """Unfinished requests with a sync load in a step in flight."""
        return sorted(
            r
            for step in self.in_flight
            for r in step.sync_loads
            if r in self.scheduler.requests
            and not self.scheduler.requests[r].is_finished()
        )

    def abort_load_in_flight(self, pick: int) -> None:
        loads = self.loads_in_flight()
        req_id = loads[pick % len(loads)]
        self.note_once("abort with a sync load in flight")
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def fail_sync_load(
        self,
        args: dict,
        fail: int | None,
        leaves: str | None,
        again: bool,
        num_steps: int,
    ) -> str:
        """Add a request whose external tokens load synchronously (`args`) and
        run `num_steps` engine steps. Its load fails when the step that loads
        it returns (`fail` picks the blocks, as `fail_sync`; None: it does
        not). While that step is in flight and the request runs, it may
        leave the running requests: with `leaves="memory"` the pool is short
        of blocks for every running request's allocation that takes any (the
        scheduler preempts for memory until the request is preempted, or
        nothing needs a block); with `leaves="abort"` it is aborted. With
        `again`, its prompt is sent again once that step returned.
        """
        req_id = self.add_request(**args)
        if fail is not None:
            self.fail_load_of[req_id] = fail
        request = self.scheduler.requests[req_id]
        sent_again = False
        preempt = leaves == "memory"
        for _ in range(num_steps):
            if leaves == "abort" and self._pool_short_possible(req_id):
                self.abort_load_in_flight(self.loads_in_flight().index(req_id))
                self.check_all()
            pressed = preempt and self._pool_short_possible(req_id)
            num_preemptions = request.num_preemptions
            self.short_of_blocks_for = req_id if preempt else None
            try:
                self.step(accept=0, eos_pick=None, fail_sync=None)
            finally:
                self.short_of_blocks_for = None
            if pressed and request.num_preemptions > num_preemptions:
                self.note_once("preempted for memory with a sync load in flight")
            self.check_all()
            returned = req_id in self.sync_loaded and not any(
                req_id in s.sync_loads for s in self.in_flight
            )
            if again and returned and not sent_again:
                sent_again = True
                if len(self.scheduler.requests) < 8:
                    self.add_again(req_id)
        return req_id

    def _pool_short_possible(self, req_id: str) -> bool:
        return self.running(req_id) and req_id in self.loads_in_flight()

    def stores_to_report(self) -> list[str]:
        stores = set(self.connector.saving) | set(self.connector.stores)
        return sorted(stores - self.finished_sending)

    def finish_save(self, pick: int) -> None:
        stores = self.stores_to_report()
        self.finished_sending.add(stores[pick % len(stores)])
        _note("store finished")

    # -- the model's properties on the scheduler's state
    def tables(self) -> dict[str, list[list]]:
        """req_id -> the block table of every group (requests that hold
        blocks: running, waiting for a load, finished but held)."""
        managers = self.manager.coordinator.single_type_managers
        req_ids = set().union(*(m.req_to_blocks for m in managers))
        return {
            r: [list(m.req_to_blocks.get(r, [])) for m in managers] for r in req_ids
        }

    def held(self) -> dict[str, list[int]]:
        return {
            r: [b.block_id for b in blocks]
            for r, blocks in self.manager.held_blocks.items()
        }

    def free_block_ids(self) -> set[int]:
        return {b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()}

    def running(self, req_id: str) -> bool:
        request = self.scheduler.requests.get(req_id)
        return request is not None and request.status == RequestStatus.RUNNING

    def transfers(self) -> dict[str, set[int]]:
        """Loads (async, and the sync loads of the steps in flight of running
        requests) and the delayed frees of finished requests. A request
        preempted with a step in flight gives its blocks back at once, as on
        0.13.0: a later step runs after it (one stream), and the prefix cache
        drops the blocks whose load that step reports failed."""
        out: dict[str, set[int]] = {}
        loads = list(self.connector.pending.items())
        for step in self.in_flight:
            loads += [
                (r, load) for r, load in step.sync_loads.items() if self.running(r)
            ]
        for req_id, load in loads:
            out.setdefault(req_id, set()).update(load.all_block_ids())
        for req_id, block_ids in self.connector.saving.items():
            out.setdefault(req_id, set()).update(block_ids)
        return out

    def check_all(self) -> None:
        """Every safety property; a failure names the property (as in
        spec/HybridKVAlloc.tla, or the table of the module docstring)."""
        if len(self.eviction_order.last_released) > 1:
            _note("held blocks released together")
        for name, check in self.safety_checks():
            try:
                check()
            except AssertionError as exc:
                raise AssertionError(f"{name} violated: {exc}") from exc
        if self.violations:
            raise AssertionError(self.violations[0])

    def safety_checks(self) -> list[tuple[str, Callable[[], None]]]:
        """The safety properties on the scheduler's state as it is now: each
        one's name and its check, which raises an AssertionError."""
        tables = self.tables()
        held = self.held()
        free = self.free_block_ids()
        return [
            ("Conservation", lambda: self.check_conservation(tables, held, free)),
            ("ExclusiveOwnership", lambda: self.check_exclusive_ownership(tables)),
            ("NoTransferRace", lambda: self.check_no_transfer_race(tables, free)),
            ("RefCount", lambda: self.check_ref_counts(tables, held)),
            ("NullPrefix", lambda: self.check_null_prefix(tables)),
            ("WindowBound", lambda: self.check_window_bound(tables)),
            ("ExactAdmission", self.check_exact_admission),
            ("NoPrematurePublish", lambda: self.check_no_premature_publish(tables)),
            ("InFlightRead", lambda: self.check_in_flight_read(free)),
            ("StoreHold", lambda: self.check_store_hold(tables, held, free)),
            ("PlainConnectorBlocks", self.check_plain_connector_blocks),
            ("ResumeAfterLoad", self.check_resume_after_load),
            ("ConnectorTables", self.check_connector_tables),
            ("HoldPending", lambda: self.check_hold_pending(tables, held)),
            ("NoReload", self.check_no_reload),
            ("FinishedTables", self.check_finished_tables),
            ("LiveRecords", self.check_live_records),
            ("EvictionOrder", lambda: self.eviction_order.check()),
        ]

    def check_live_records(self) -> None:
        """The connector side of a request lives no longer than the request:
        every record of `scheduler.kv_connector_requests` belongs to a request
        the scheduler still has (`scheduler.requests`) and is not empty, each
        of its fields is set only in the state the field stands for, and no
        record of a finished request holds more than what keeps the request
        (a delayed free, a load in flight of an aborted request) and what its
        steps in flight own. The blocks of a load in flight and held blocks
        are the exceptions that may outlive the request: the first until the
        loading step returned, the second until the connector reports it in
        `finished_sending` and `request_blocks_freed` no longer names them,
        so every held block is one the connector's store still reads."""
        scheduler = self.scheduler
        requests = scheduler.requests
        live = {r for r, req in requests.items() if not req.is_finished()}
        kept = set(requests) - live
        loading = {
            r
            for r in live
            if requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        in_flight: Counter[str] = Counter()
        for step in self.in_flight:
            in_flight.update(step.output.num_scheduled_tokens)
        records = scheduler.kv_connector_requests
        gone = set(records) - set(requests)
        assert not gone, f"records of requests the scheduler no longer has: {gone}"
        empty = sorted(r for r, record in records.items() if record.is_empty())
        assert not empty, f"empty records {empty}"
        stepping = set(requests) & set(in_flight)
        for name, allowed in [
            ("finished_recving", loading),
            ("failed_recving", loading),
            ("load_failed", live),
            ("recving", loading | kept),
            ("num_computed_tokens_after_recving", loading),
            ("num_external_tokens_in_flight", stepping),
            ("sending", kept),
            ("discard_output", stepping),
            ("preempted_to_report", live),
        ]:
            stray = set(connector_state(scheduler, name)) - allowed
            assert not stray, f"records of {sorted(stray)} have {name}"
        stray = set(scheduler.held_since_output) - set(self.manager.held_blocks)
        assert not stray, f"held_since_output holds {sorted(stray)}"
        # The blocks of a request preempted or aborted while the step that
        # loads it synchronously is in flight: owned by that step, they may
        # outlive the request until it returned.
        freed = getattr(scheduler, "freed_blocks_of_loads_in_flight", {})
        stray = set(freed) - set(in_flight)
        assert not stray, f"freed_blocks_of_loads_in_flight holds {sorted(stray)}"
        # A finished request stays only while something keeps its blocks.
        unkept = (
            kept
            - set(connector_state(scheduler, "sending"))
            - set(connector_state(scheduler, "recving"))
        )
        assert not unkept, f"finished requests {sorted(unkept)} are never freed"
        # The in-flight fence counts exactly the tokens of the steps in flight.
        for req_id, request in requests.items():
            expected = in_flight[req_id] + records.num_external_tokens_in_flight(req_id)
            assert request.num_in_flight_tokens == expected, (
                f"{req_id}.num_in_flight_tokens",
                request.num_in_flight_tokens,
                expected,
            )
        # Held blocks: the connector still reads them (a store it has not
        # reported), whether the request is live, finished or gone.
        reading = self.connector.stores
        for req_id, blocks in self.manager.held_blocks.items():
            assert blocks, f"held_blocks holds an empty entry for {req_id}"
            unread = {b.block_id for b in blocks} - reading.get(req_id, set())
            assert not unread, f"{req_id}: held blocks {sorted(unread)} nobody reads"
        if set(self.manager.held_blocks) - set(requests):
            _note("held blocks outlive their request")

    def check_no_reload(self) -> None:
        """A request that held a block whose load of its failed starts no
        load again (the connector offers the same tokens, and its load could
        fail again, for ever)."""
        assert not self.connector.reload_violations, self.connector.reload_violations[0]

    def check_valid_hits(self) -> None:
        """ValidHit, once the step ran (a block a step computes may be hit in
        the same step): no prefix cache hit of the schedule, in any group, is
        a block whose load failed and that no step wrote since, or a block a
        step computed on KV that failed to load (once the failure is
        reported, e.g. after the request was preempted or aborted with that
        step in flight)."""
        for req_id, groups in self.hits:
            for group, block_ids in enumerate(groups):
                for block_id in block_ids:
                    block = self.pool.blocks[block_id]
                    if block.is_null:
                        continue
                    if self.invalid_slots.get(block_id):
                        self.violations.append(
                            f"ValidHit violated: {req_id} hits block {block_id} "
                            f"(group {group}) whose load failed"
                        )
                        return
                    computed_hash = self.computed_on_failed.get(block_id)
                    if computed_hash is not None and computed_hash == block.block_hash:
                        self.violations.append(
                            f"ValidHit violated: {req_id} hits block {block_id} "
                            f"(group {group}) computed on KV that failed to load"
                        )
                        return

    def check_finished_tables(self) -> None:
        """FinishedTables (`MachineChecks._check_finished_tables`)."""
        assert not self.connector.finish_violations, self.connector.finish_violations[0]

    def check_recached(self, output: SchedulerOutput) -> None:
        """Right after `schedule`: every real block of the full blocks a
        scheduled request has computed or computes in the step is in the
        prefix cache, in every group; after a load failure evicted blocks,
        they are cached again when the request computes them again."""
        for req_id in output.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            if request.status != RequestStatus.RUNNING:
                continue
            num_full = min(request.num_computed_tokens, request.num_tokens)
            num_full //= BLOCK_SIZE
            for group, table in enumerate(self.tables().get(req_id, [])):
                for i, b in enumerate(table[:num_full]):
                    if not b.is_null and b.block_hash is None:
                        self.violations.append(
                            f"Recached violated: block {i} ({b.block_id}, "
                            f"group {group}) of {req_id} is computed but not "
                            "in the prefix cache"
                        )
                        return

    def check_connector_tables(self) -> None:
        """A connector that appends the block ids of each
        `update_state_after_alloc` call has the request's block tables, no
        block twice (`MachineChecks._check_tables`)."""
        assert not self.connector.table_violations, self.connector.table_violations[0]

    def check_resume_after_load(self) -> None:
        """A request resumes after an async load with at most its local hit +
        external tokens computed (the rest of a partly loaded block is
        computed, not taken as loaded); after a failure its external tokens
        are those before the truncation."""
        scheduler, connector = self.scheduler, self.connector
        for req_id, end in connector.async_load_end.items():
            request = scheduler.requests.get(req_id)
            if request is None or req_id in connector.pending:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            assert request.num_cached_tokens <= end, (
                req_id,
                request.num_cached_tokens,
                end,
            )
        for req_id in connector_state(scheduler, "failed_recving"):
            request = scheduler.requests[req_id]
            start = connector.async_load_start[req_id]
            assert request.num_external_computed_tokens == max(
                0, request.num_computed_tokens - start
            ), (
                req_id,
                request.num_external_computed_tokens,
                request.num_computed_tokens,
            )

    def check_conservation(self, tables, held, free) -> None:
        null = self.pool.null_block
        blocks = self.pool.blocks
        assert null.block_id not in free
        assert self.pool.free_block_queue.num_free_blocks == len(free)
        assert all(blocks[b].ref_cnt == 0 for b in free)
        num_referenced = sum(b.ref_cnt > 0 for b in blocks if not b.is_null)
        assert len(free) + num_referenced == len(blocks) - 1
        owned = {b.block_id for t in tables.values() for g in t for b in g}
        owned |= {b for blocks in held.values() for b in blocks}
        for b in blocks:
            if not b.is_null and b.ref_cnt > 0:
                assert b.block_id in owned, f"block {b.block_id} leaked"
        for block_ids in self.transfers().values():
            assert null.block_id not in block_ids

    def check_exclusive_ownership(self, tables) -> None:
        owner: dict[int, tuple[str, int, int]] = {}
        for req_id, groups in tables.items():
            for g, table in enumerate(groups):
                for i, b in enumerate(table):
                    if b.is_null:
                        continue
                    if b.block_id not in owner:
                        owner[b.block_id] = (req_id, g, i)
                        continue
                    other_req, other_g, other_i = owner[b.block_id]
                    assert other_req != req_id, f"{b.block_id} twice in {req_id}"
                    # Shared only as the same prefix cache hit, or as one
                    # that a load failure took out of the prefix cache (the
                    # invalid block and every block after it in the holders'
                    # tables: its holders compute it again).
                    assert (other_g, other_i) == (g, i), b.block_id
                    assert b.block_hash is not None or b.block_id in self.evicted, (
                        b.block_id
                    )

    def check_no_transfer_race(self, tables, free) -> None:
        for req_id, block_ids in self.transfers().items():
            own = {b.block_id for g in tables.get(req_id, []) for b in g}
            for block_id in block_ids:
                assert block_id not in free, (req_id, block_id)
                assert block_id in own, (req_id, block_id)
        for req_id, load in self.connector.pending.items():
            for other, groups in tables.items():
                if other != req_id:
                    others = {b.block_id for g in groups for b in g}
                    assert not load.all_block_ids() & others, (req_id, other)

    def check_ref_counts(self, tables, held) -> None:
        entries: Counter[int] = Counter(
            b.block_id for t in tables.values() for g in t for b in g if not b.is_null
        )
        entries.update(b for blocks in held.values() for b in blocks)
        for b in self.pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == entries[b.block_id], b.block_id

    def check_null_prefix(self, tables) -> None:
        for groups in tables.values():
            for kind, table in zip(self.kinds, groups, strict=True):
                nulls = [b.is_null for b in table]
                num_null = nulls.index(False) if False in nulls else len(nulls)
                assert not any(nulls[num_null:]), nulls
                if kind == "full":
                    assert num_null == 0
                elif num_null:
                    _note("null blocks in a sliding window table")

    def check_window_bound(self, tables) -> None:
        """Right after its last allocation (tables only grow there), a sliding
        window table holds at most ceil((W-1)/B) + 1 real blocks plus those
        of the tokens in flight and looked ahead. A connector without HMA
        gets a block for every external token (0.13.0's allocate-then-free),
        so the bound is checked with a SupportsHMA connector only. With EAGLE
        a table that starts after external tokens keeps the blocks before the
        window of the first computed token that the hit a later request takes
        in them reads: one block more per block the lookup drops (vLLM
        0.13.0's with full attention and sliding window: two), as the groups
        share one block size here."""
        if self.setup.plain:
            return
        contig = cdiv(self.setup.window - 1, BLOCK_SIZE)
        manager = self.scheduler.kv_cache_manager
        eagle = cdiv(getattr(manager, "eagle_hit_alignment", 0), BLOCK_SIZE)
        eagle *= getattr(manager.coordinator, "num_eagle_dropped_blocks", 1)
        for req_id, groups in tables.items():
            n = self.last_allocated.get(req_id, 0)
            # only a request the connector offers external tokens to
            kept = eagle if req_id in self.connector.offers else 0
            for kind, table in zip(self.kinds, groups, strict=True):
                if kind == "full":
                    continue
                num_real = sum(not b.is_null for b in table)
                assert num_real <= contig + kept + 1 + cdiv(n, BLOCK_SIZE), (
                    req_id,
                    num_real,
                    n,
                )

    def check_exact_admission(self) -> None:
        for predicted, free_before, free_after in self.admissions:
            if free_after is None:
                assert predicted > free_before
                _note("allocation refused")
            else:
                assert free_before - free_after == predicted
        self.admissions.clear()

    def check_no_premature_publish(self, tables) -> None:
        for load in self.connector.pending.values():
            for block_id in load.all_block_ids():
                assert self.pool.blocks[block_id].block_hash is None, block_id
        for req_id, groups in tables.items():
            request = self.scheduler.requests[req_id]
            for table in groups:
                for i, b in enumerate(table):
                    if not b.is_null and (i + 1) * BLOCK_SIZE > request.num_tokens:
                        assert b.block_hash is None, (req_id, i)

    def check_in_flight_read(self, free) -> None:
        """No block that a step in flight reads or writes is free while its
        request runs (see `transfers` for a preempted one)."""
        for step in self.in_flight:
            for req_id in step.output.num_scheduled_tokens:
                if not self.running(req_id):
                    continue
                used = step.reads.get(req_id, set()) | step.writes.get(req_id, set())
                assert not used & free, (req_id, sorted(used & free))

    def check_store_hold(self, tables, held, free) -> None:
        """A block that a store still reads is allocated, in the request's
        table or held for it."""
        for req_id, block_ids in self.connector.stores.items():
            own = {b.block_id for g in tables.get(req_id, []) for b in g}
            own |= set(held.get(req_id, ()))
            for block_id in block_ids:
                assert block_id not in free, (req_id, block_id)
                assert block_id in own, (req_id, block_id)
            if block_ids - {b.block_id for g in tables.get(req_id, []) for b in g}:
                _note("store reads a block outside the table")

    def check_hold_pending(self, tables, held) -> None:
        """Blocks kept for a request that neither waits nor runs (a delayed
        free, blocks held for a store, a load in flight of an aborted
        request), or a finished request kept until the connector reports it,
        are pending work: `has_requests()` is True, so the engine steps and
        collects the connector's report. With none of them, no request
        waiting or running and no finished id to return, it is False (the
        engine waits for requests instead of stepping)."""
        scheduler = self.scheduler
        live = {r.request_id for r in scheduler.running}
        live |= {r.request_id for r in scheduler.waiting}
        kept = {
            r
            for r, groups in tables.items()
            if r not in live and any(not b.is_null for g in groups for b in g)
        }
        kept |= {r for r, block_ids in held.items() if r not in live and block_ids}
        # A finished request kept until the connector reports it (a delayed
        # free or a load in flight), whatever blocks it has.
        kept |= {r for r, req in scheduler.requests.items() if req.is_finished()}
        if kept and not live:
            _note("blocks kept with no request left")
        expected = bool(live or scheduler.finished_req_ids or kept)
        assert scheduler.has_requests() == expected, (sorted(live), sorted(kept))

    def check_plain_connector_blocks(self) -> None:
        """A connector without HMA support, or one that declined it, gets a
        real block for every external token (what vLLM 0.13.0 gave it)."""
        if not self.setup.plain:
            return
        loads = list(self.connector.pending.values()) + list(
            self.connector.sync_loads.values()
        )
        for load in loads:
            assert not load.null_in_range, load

    def check_progress(self, progressed: bool) -> None:
        """The stall: STALL_STEPS steps in a row schedule and finish nothing,
        nothing runs, nothing is pending outside the scheduler (a load or a
        store to report, a step in flight that computes something), and
        waiting requests other than the first one hold blocks that could let
        it go on. (A request that cannot fit an empty pool on its own is no
        stall of this kind.)"""
        scheduler = self.scheduler
        tables = self.tables()
        first = scheduler.waiting.peek_request() if scheduler.waiting else None
        holders = [
            r.request_id
            for r in scheduler.waiting
            if r is not first
            and any(not b.is_null for g in tables.get(r.request_id, []) for b in g)
        ]
        stalled = not (
            progressed
            or scheduler.running
            or self.connector.pending
            or self.finished_recving
            or self.connector.stores
            or self.connector.saving
            or any(s.output.total_num_scheduled_tokens for s in self.in_flight)
        ) and bool(holders)
        self.idle_steps = self.idle_steps + 1 if stalled else 0
        if self.idle_steps >= STALL_STEPS:
            self.violations.append(
                f"Progress violated: nothing scheduled for {self.idle_steps} "
                f"steps, nothing runs, and waiting requests {holders} hold "
                f"blocks that {first.request_id if first else None} needs"
            )


def check_mamba_rejected(setup: Setup) -> None:
    """A KV cache config with a Mamba group cannot get this connector."""
    connector_cls = connector_class(setup)
    config = KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attention"], FullAttentionSpec(BLOCK_SIZE, 1, 1, torch.float32)
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=BLOCK_SIZE, shapes=((1,),), dtypes=(torch.float32,)
                ),
            ),
        ],
    )
    try:
        KVConnectorFactory.create_connector(
            machine_vllm_config(setup, connector_cls), KVConnectorRole.SCHEDULER, config
        )
    except ValueError as exc:
        assert "Mamba" in str(exc), exc
    else:
        raise AssertionError(
            "MambaRejected violated: the connector was created with a Mamba group"
        )


# -- the explicit tests' requests -----------------------------------------------


def req_args(**kwargs) -> dict:
    """The arguments of `Harness.add_request` (as the machine's rules draw
    them): a one-token prompt with one token to generate, unless `kwargs`
    says otherwise."""
    args = dict(
        prefix=0,
        num_own=1,
        num_external=0,
        load_async=False,
        max_tokens=1,
        save=False,
    )
    args.update(kwargs)
    return args
