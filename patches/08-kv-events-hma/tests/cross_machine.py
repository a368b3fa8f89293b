"""Stage 08: the check that crosses the stages, a stateful random test of the
real `Scheduler` (and `AsyncScheduler`, and the batch queue) with the real KV
connectors of the series, EAGLE, the KV cache layouts and the KV cache events
of every medium, so that every pair of stages meets in one schedule.

Each example draws a `CrossSetup`:

- `connector`: `offload` (OffloadingConnector over vLLM's LRU or ARC manager
  with a CPU backend, `manager`), `nixl` (NixlConnector: a producer engine
  that prefills with `do_remote_decode` and a consumer engine that reads its
  KV, `do_remote_prefill` with the producer's KV transfer params), or `multi`
  (MultiConnector over NixlConnector and OffloadingConnector, on both engines
  of the same P/D pair);
- `eagle`: EAGLE on (a speculative config of method eagle: lookahead slots,
  draft tokens, the prefix cache hit of stage 05) or off;
- `layout`: one full attention group (`full`), full attention + sliding
  window (`full_sw`, gpt-oss-like), full attention + chunked local attention
  (`full_chunked`, Llama-4-like; with EAGLE, VllmConfig runs such a model
  with the hybrid KV cache manager off: one full attention group), or three
  sliding window groups + full attention (`windows`, Gemma-3-like);
- `scheduling`: `sync`, `async` (AsyncScheduler) or `batch_queue` (the
  engine core's batch queue of depth 2; without speculative decoding, as
  vLLM runs it).

KV cache events are on (`enable_kv_cache_events`) on every engine.

The engines' scheduler sides are vLLM's as they are in the series; the worker
sides are the boundary, and the machine scripts what they report:
OffloadingConnector's real worker side over a transfer handler whose jobs
finish when a rule says so (`hmastack_testkit.offloading.
NoCopyOffloadingSpec` with scripted transfers: a store done, a load done, a
load failed, the latter as the load's blocks in `invalid_block_ids`);
NixlConnector's worker side is `ScriptedNixlWorker` (a read done, which
notifies the producer; a read failed, every local block invalid as NIXL
reports it; the producer's expiry of a request no consumer reads any more);
MultiConnector's worker side is vLLM's over those two. vLLM's CPU engine
cannot run speculative decoding (its CPU model runner refuses a speculative
config), so EAGLE meets the connectors here, at the scheduler, and in the
worker-level tests with real NIXL agents over UCX.

Rules: add a request (shared prefixes give prefix cache hits; on a P/D pair a
request to the producer with `do_remote_decode`, or a request of its own to
either engine), send a prompt again, forward a request the producer
finished to the consumer (its KV transfer params), run engine steps
(sampled and accepted draft tokens, EOS, max_tokens), drain the steps in
flight, finish a transfer (a store, a load, a NIXL read) or all of them,
fail a load or a read, let the producer expire a request no consumer reads,
reset an engine's prefix cache, abort a request; and two round trips: a
request through the P/D pair (`pd_round_trip`) and a prompt stored to the
CPU tier, evicted from the engine's prefix cache and sent again
(`tier_round_trip`), whose prompts end their prefill with a chunk of a few
tokens around a block boundary (`TAILS`), where the windows of two sides
and of EAGLE's hit differ.

After every rule, and in the middle of each step, on every engine:

- `NothingRaises`: no exception leaves the scheduler or a connector's
  scheduler side;
- s03's block ownership invariants on the real state (`Conservation`,
  `ExclusiveOwnership`, `NoTransferRace`, `RefCount`, `NullPrefix`,
  `WindowBound`, `ExactAdmission`, `NoPrematurePublish`, `InFlightRead`,
  `InvalidKVRead`, `StoreHold`, `HoldPending`, `LiveRecords`: see
  `hmastack_testkit.scheduler_machine`; a store reads the blocks of
  every job the worker side still runs and those the scheduler side still
  keeps a record of);
- `LoadableHit`: every block of every group that the scheduler allocated for
  the external tokens a connector claimed is one it can load: the offloading
  manager holds it, ready (OffloadingConnector), or the producer holds the
  block at the same position of the same group for the request it names
  (NixlConnector; a read given up as unreadable is a claimed hit that cannot
  be loaded);
- `EventsNameBlockAndGroup`: every event of every medium names its KV cache
  group, and a connector tier's events name blocks by a block hash the
  engine published;
- `TierEventsExact`: the CPU tier's events (their keys read as block hash
  and group) say what the offloading manager holds;
- `RouterPredictsHit`: a router that keeps an index per medium built
  from the events (and the KV cache groups of the engine's configuration;
  the events decoded from vLLM's msgpack encoding with
  `hmastack_testkit.kv_events`) predicts, at each lookup of a request, the
  engine's prefix cache hit (`Index.predict`, the rule stage 08 publishes)
  and the tokens the connector's tier adds (the blocks each group reads,
  from the local hit on);
- `ProducerOffersReads`: a P/D producer's request that computed its whole
  prompt (no prefix cache hit, no tokens a connector loaded) offers a real
  block at every position of every group that the consumer's scheduler
  allocates for the whole prompt as external tokens (with EAGLE, the
  window one block earlier): the consumer reads all of it;
- `EvictionOrder`: blocks of a request go back to the free queue in the
  order vLLM 0.13.0's immediate free gives them: in the order they left the
  request's block tables and, of one leave, group by group, each group's
  blocks tail first; the held blocks one `update_from_output` releases
  enter the queue one after the other in that order (the definition of
  `hmastack_testkit.eviction_order`).

A store's bookkeeping cost (the issue's kind 6) is not a property here: the
instruction counts measure it.

Known failures (`EXPECTED_FAILURES`: the kinds the series has today, those
of issue "where stages meet" and the new ones this machine found): a
violation that the classification of its property attributes to an
expected kind is recorded (`KNOWN_SEEN`, the scenario in `KNOWN_FIRST`)
instead of failing the example; the example ends if the violation leaves
the scheduler's state unusable (a claimed hit that is not loadable would
raise out of `schedule()`). Any other violation (a kind not expected, or a
new kind) fails the example with its property's name. Removing a kind from
`EXPECTED_FAILURES` makes it strict; `HMASTACK_CROSS_STRICT=all` makes every
kind strict, `=1,5` kinds 1 and 5.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import traceback
from collections import Counter
from dataclasses import dataclass

import msgspec
from hmastack_testkit import kv_events as router_events
from hmastack_testkit import scheduler_machine as s03
from hmastack_testkit import scripted_nixl
from hmastack_testkit.kvtest import (
    make_cpu_vllm_config,
    make_kv_cache_groups,
    make_scheduler,
)
from hmastack_testkit.offloading import NoCopyHandler
from hmastack_testkit.scripted_connector import Load
from hmastack_testkit.scripted_nixl import PDLink, ScriptedNixlWorker
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import _current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
    NixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import BlockTableLayout
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

BLOCK_SIZE = s03.BLOCK_SIZE
MAX_MODEL_LEN = s03.MAX_MODEL_LEN
PREFIX_BLOCKS = s03.PREFIX_BLOCKS
NUM_SPEC_TOKENS = 2
MAX_REQUESTS = 8

CONNECTORS = ("offload", "nixl", "multi")
MANAGERS = ("lru", "arc")
LAYOUTS = {
    "full": ["full"],
    "full_sw": ["full", "sliding_window"],
    "full_chunked": ["full", "chunked_local"],
    "windows": ["sliding_window"] * 3 + ["full"],
}
SCHEDULINGS = ("sync", "async", "batch_queue")

# The kinds of issue "where stages meet" (and those this machine found) that
# the series fails today. A violation attributed to one of them is recorded,
# not raised; a kind whose fix is in the series moves to FIXED_KINDS, where
# the machine is strict on it.
EXPECTED_FAILURES: dict[int, str] = {}

# The kinds the series fixes: a violation of one of them fails the example
# (their schedules are the plain test_kind_* tests).
FIXED_KINDS: dict[int, str] = {
    1: (
        "a connector's lookup and its load disagree on which blocks a hit "
        "needs (OffloadingConnector with EAGLE: the sliding window block "
        "before the window of the computed tokens)"
    ),
    2: (
        "P/D when the two sides keep different windows (a consumer with "
        "EAGLE reads a sliding window block the producer already dropped)"
    ),
    3: (
        "KV events of a connector's medium do not name their block and "
        "group (OffloadingConnector's CPU tier publishes its internal keys)"
    ),
    4: (
        "the router's rule ignores EAGLE (a KV cache group the router knows "
        "from the engine's configuration before its first event never learns "
        "the events' use_eagle)"
    ),
    5: "a deferred free releases held blocks in table order, not tail first",
    7: (
        "P/D with one KV cache group and EAGLE: the producer's block table "
        "ends with a lookahead block past the prompt (a chunked prefill), and "
        "the consumer pairs its blocks with the tail of remote_block_ids, one "
        "position off"
    ),
    9: (
        "ARC's prepare_store evicts blocks and then refuses the store when it "
        "cannot make room for all of it: the evicted blocks get no "
        "BlockRemoved event (vLLM 0.13.0's ARCOffloadingManager)"
    ),
    8: (
        "MultiConnector withholds one connector's report of a finished "
        "request while another one's asynchronous save of it runs: blocks "
        "held for the first one's stores stay held after they finished"
    ),
    10: (
        "OffloadingConnector's lookup needs the last block of a hit in every "
        "KV cache group: a chunked local attention group at a chunk boundary "
        "holds the null block there, and a hit the tier serves is not claimed"
    ),
    11: (
        "a P/D producer's NixlConnector stops holding, at the finish, a block "
        "it held (a resumed request whose table has a real block at its "
        "position again, or a preempted request aborted): the scheduler keeps "
        "it held, read by nobody, until the worker side reports the request"
    ),
}


# Kinds made strict by a test (`strict`), beside HMASTACK_CROSS_STRICT.
_STRICT: set = set()


def is_strict(kind) -> bool:
    """Whether a violation of `kind` fails the example although the kind is
    expected: `HMASTACK_CROSS_STRICT=all` (or a comma-separated list of
    kinds), or a test's `strict`. (`hmastack conform` runs the machine as it
    is on a broken tree: a break of a fixed kind, no longer expected, fails
    it; the kinds the series still has do not.)"""
    if "all" in _STRICT or kind in _STRICT:
        return True
    listed = os.environ.get("HMASTACK_CROSS_STRICT", "")
    kinds = {k.strip() for k in listed.split(",") if k.strip()}
    return "all" in kinds or str(kind) in kinds


class strict:
    """A context in which the given kinds (default: every kind) are strict."""

    def __init__(self, *kinds) -> None:
        self.kinds = set(kinds) or {"all"}

    def __enter__(self):
        self.added = self.kinds - _STRICT
        _STRICT.update(self.added)

    def __exit__(self, *exc):
        _STRICT.difference_update(self.added)


# What the examples exercised, and the known failures they met (per kind:
# how often, and the first scenario), for the tests of the fixed set.
COVERAGE: Counter[str] = Counter()
KNOWN_SEEN: Counter[int] = Counter()
KNOWN_FIRST: dict[int, str] = {}


def _note(what: str) -> None:
    if _current_build_context.value is not None:  # inside a hypothesis test
        COVERAGE[what] += 1
        event(what)


class KnownFailure(Exception):
    """A violation of an expected kind that leaves the scheduler's state
    unusable: the example ends (see `CrossMachine`)."""


# -- the setup ------------------------------------------------------------------


@dataclass(frozen=True)
class CrossSetup:
    connector: str
    manager: str
    layout: str
    eagle: bool
    scheduling: str
    window: int = 32
    num_blocks: int = 48
    num_cpu_blocks: int = 32
    max_num_batched_tokens: int = 64
    fail_policy: str = "recompute"

    def __post_init__(self):
        if self.eagle and self.scheduling == "batch_queue":
            raise ValueError("the batch queue runs without speculative decoding")

    # What s03's Harness reads of its setup.
    plain = False

    @property
    def async_scheduling(self) -> bool:
        return self.scheduling == "async"

    @property
    def batch_queue(self) -> bool:
        return self.scheduling == "batch_queue"

    @property
    def steps_in_flight(self) -> bool:
        return self.scheduling != "sync"

    @property
    def num_spec_tokens(self) -> int:
        return NUM_SPEC_TOKENS if self.eagle else 0

    @property
    def hma(self) -> bool:
        """VllmConfig turns the hybrid KV cache manager off for chunked local
        attention with EAGLE."""
        return not (self.layout == "full_chunked" and self.eagle)

    @property
    def kinds(self) -> list[str]:
        """The KV cache groups' attention kinds (HMA off: every layer is
        served as full attention, one group)."""
        return LAYOUTS[self.layout] if self.hma else ["full"]

    @property
    def pd(self) -> bool:
        return self.connector in ("nixl", "multi")

    @property
    def offloads(self) -> bool:
        return self.connector in ("offload", "multi")

    def label(self) -> str:
        manager = f"-{self.manager}" if self.offloads else ""
        eagle = "eagle" if self.eagle else "no-eagle"
        return f"{self.connector}{manager}-{self.layout}-{eagle}-{self.scheduling}"


def all_setups() -> list[CrossSetup]:
    """The cross product (connector x manager x layout x EAGLE x
    scheduling), without the batch queue with EAGLE and without a manager
    for NIXL alone."""
    out = []
    for connector, manager, layout, eagle, scheduling in itertools.product(
        CONNECTORS, MANAGERS, LAYOUTS, (False, True), SCHEDULINGS
    ):
        if eagle and scheduling == "batch_queue":
            continue
        if connector == "nixl" and manager != MANAGERS[0]:
            continue
        out.append(CrossSetup(connector, manager, layout, eagle, scheduling))
    return out


# -- the connectors' worker sides -------------------------------------------------


SCRIPTED_NIXL = "HmastackScriptedNixlWorker"
if SCRIPTED_NIXL not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(
        SCRIPTED_NIXL, scripted_nixl.__name__, ScriptedNixlWorker.__name__
    )


def _offload_config(setup: CrossSetup) -> dict:
    return dict(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "NoCopyOffloadingSpec",
            "spec_module_path": "hmastack_testkit.offloading",
            "scripted_transfers": True,
            "num_cpu_blocks": setup.num_cpu_blocks,
            "eviction_policy": setup.manager,
        },
    )


def kv_transfer_config(setup: CrossSetup, engine_id: str) -> KVTransferConfig:
    common = dict(
        kv_role="kv_both",
        engine_id=engine_id,
        kv_load_failure_policy=setup.fail_policy,
    )
    if setup.connector == "offload":
        return KVTransferConfig(**(_offload_config(setup) | common))
    if setup.connector == "nixl":
        return KVTransferConfig(kv_connector="NixlConnector", **common)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_connector_extra_config={
            "connectors": [
                dict(kv_connector="NixlConnector", kv_role="kv_both"),
                _offload_config(setup),
            ]
        },
        **common,
    )


def worker_side(setup: CrossSetup, vllm_config, kv_cache_config):
    """The worker-side connector of an engine (see the module docstring)."""
    if setup.connector == "nixl":
        return ScriptedNixlWorker(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    if setup.connector == "offload":
        worker = OffloadingConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        worker.connector_worker._register_handlers({}, {})
        return worker
    config = copy.copy(vllm_config)
    ktc = vllm_config.kv_transfer_config
    config.kv_transfer_config = dataclasses.replace(
        ktc,
        kv_connector_extra_config={
            "connectors": [
                dict(kv_connector=SCRIPTED_NIXL, kv_role="kv_both"),
                _offload_config(setup),
            ]
        },
    )
    worker = MultiConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker._connectors[1].connector_worker._register_handlers({}, {})
    return worker


def sub_connectors(connector) -> list:
    return (
        list(connector._connectors)
        if isinstance(connector, MultiConnector)
        else [connector]
    )


# -- the router -----------------------------------------------------------------

ENCODER = msgspec.msgpack.Encoder()


def _eagle_predict(index: router_events.Index, tokens: list[int]) -> int:
    """The classification's EAGLE rule (stage 05): the longest hit L, below
    the last token with the block after it, that every group serves together
    with that block."""
    groups = [g for g in index.groups.values() if g.block_size]
    if not groups:
        return 0
    step = math.lcm(*(g.block_size for g in groups))
    hashes = {g.block_size: index.block_hashes(tokens, g.block_size) for g in groups}
    for num_tokens in range((len(tokens) - 1) // step * step, 0, -step):
        if all(
            num_tokens + g.block_size <= len(tokens) - 1
            and g.serves(hashes[g.block_size], num_tokens)
            and len(hashes[g.block_size]) > num_tokens // g.block_size
            and hashes[g.block_size][num_tokens // g.block_size] in g.holds()
            for g in groups
        ):
            return num_tokens
    return 0


def _fixed_hash(block_hash, group_idx):
    """A connector tier's key as the engine's events name it: (block hash as
    the engine publishes it, group)."""
    if isinstance(block_hash, bytes):
        if len(block_hash) > 32:
            return maybe_convert_block_hash(get_block_hash(block_hash)), get_group_id(
                block_hash
            )
        return maybe_convert_block_hash(block_hash), group_idx
    return block_hash, group_idx


class Router:
    """A KV-aware router's view of one engine, kept from its KV cache events
    and its configuration's KV cache groups (`configure`): one
    `hmastack_testkit.kv_events.Index` per medium (the engine's GPU blocks,
    a connector's tier), fed with each batch as the publisher encodes it.
    `fixed` is the classification's index of a connector tier whose keys are
    decoded into (block hash, group)."""

    def __init__(self) -> None:
        self.indexes: dict[str, router_events.Index] = {}
        self.fixed: dict[str, router_events.Index] = {}
        # every block hash the engine published, per group
        self.published: set = set()
        self.num_events = 0

    def configure(self, kv_cache_config: KVCacheConfig) -> None:
        """The engine's KV cache groups, as its configuration publishes them
        (a group whose blocks no event has named yet still takes part in
        every hit)."""
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                kind = router_events.Group(
                    "sliding_window", spec.block_size, window=spec.sliding_window
                )
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                kind = router_events.Group(
                    "chunked_local_attention",
                    spec.block_size,
                    chunk=spec.attention_chunk_size,
                )
            else:
                kind = router_events.Group("full_attention", spec.block_size)
            self.gpu.groups[g] = kind

    def index(self, medium: str) -> router_events.Index:
        return self.indexes.setdefault(medium, router_events.Index())

    def receive(self, events: list) -> list:
        """Apply a batch of vLLM's events (encoded, decoded as a subscriber
        decodes them); returns the decoded events."""
        payload = ENCODER.encode(KVEventBatch(ts=0.0, events=events))
        batch = router_events.DECODER.decode(payload)
        for ev in batch.events:
            self.num_events += 1
            medium = getattr(ev, "medium", None) or "GPU"
            if isinstance(ev, router_events.AllBlocksCleared):
                # The engine's block pool clears its prefix cache (a
                # connector's tier publishes no such event).
                self.gpu.apply(ev)
                continue
            # Each medium has an index of its own, which holds its blocks as
            # the index's own (GPU) medium.
            self.index(medium).apply(msgspec.structs.replace(ev, medium=None))
            if medium == "GPU":
                if isinstance(ev, router_events.BlockStored):
                    self.published.update((h, ev.group_idx) for h in ev.block_hashes)
                continue
            fixed = self.fixed.setdefault(medium, router_events.Index())
            for block_hash in ev.block_hashes:
                h, g = _fixed_hash(block_hash, ev.group_idx)
                fixed.apply(
                    msgspec.structs.replace(
                        ev, block_hashes=[h], group_idx=g, medium=None
                    )
                )
        return batch.events

    @property
    def gpu(self) -> router_events.Index:
        return self.index("GPU")

    def groups(self) -> dict[int, router_events.Group]:
        """The engine's KV cache groups, as its events describe them."""
        return {k: g for k, g in self.gpu.groups.items() if g.block_size}

    def predict_local(self, tokens: list[int], rule_eagle: bool = False) -> int:
        """The engine's prefix cache hit: the router's rule
        (`hmastack_testkit.kv_events.Index.predict`, EAGLE as the events
        say), or `rule_eagle`: the classification's EAGLE rule."""
        if rule_eagle:
            return _eagle_predict(self.gpu, tokens)
        return self.gpu.predict(tokens)

    def predict_tier(
        self,
        tier: router_events.Index | None,
        tokens: list[int],
        num_computed: int,
        loadable_with_eagle: bool | None = None,
        last_block_everywhere: bool = False,
    ) -> int:
        """The tokens a connector tier adds after `num_computed` locally
        computed ones: the longest prefix of full blocks whose blocks from
        the local hit on every group needs are in the tier (full attention:
        all; sliding window, chunked local attention: those its layers read
        after the hit), at least one block: the blocks the scheduler
        allocates for them, with EAGLE (`loadable_with_eagle`; None: as the
        events say, `use_eagle`) the window of the hit a later request
        takes, one block earlier.
        `last_block_everywhere`: every group needs the last block of the hit
        (kind 10's rule: also a chunked local attention group at a chunk
        boundary, whose table holds the null block there)."""
        groups = self.groups()
        if tier is None or not groups:
            return 0
        if loadable_with_eagle is None:
            loadable_with_eagle = any(g.use_eagle for g in groups.values())
        num_blocks = len(tokens) // BLOCK_SIZE
        if num_blocks * BLOCK_SIZE - num_computed < BLOCK_SIZE:
            return 0
        start = num_computed // BLOCK_SIZE
        hashes = self.gpu.block_hashes(tokens, BLOCK_SIZE)
        for hit in range(min(num_blocks, len(hashes)), start, -1):
            if all(
                self._tier_serves(
                    tier.groups.get(idx),
                    group,
                    hashes,
                    start,
                    hit,
                    len(tokens),
                    loadable_with_eagle,
                    last_block_everywhere,
                )
                for idx, group in groups.items()
            ):
                num_tokens = hit * BLOCK_SIZE - num_computed
                return num_tokens if num_tokens >= BLOCK_SIZE else 0
        return 0

    @staticmethod
    def _tier_serves(tier_group, group, hashes, start, hit, num_tokens, eagle, last):
        resident = tier_group.holds() if tier_group is not None else set()
        first = start
        if group.kind != "full_attention":
            # The tokens whose skipped blocks the group's table starts with:
            # the scheduler computes the last token of a whole prompt again.
            end = min(hit * BLOCK_SIZE, num_tokens - 1)
            if eagle:
                end = (end - 1) // BLOCK_SIZE * BLOCK_SIZE
            if group.kind == "sliding_window":
                skipped = max(0, end - group.window + 1)
            else:
                skipped = end // group.chunk * group.chunk
            first = max(start, skipped // BLOCK_SIZE)
            if last:
                first = min(first, hit - 1)
        return all(h in resident for h in hashes[first:hit])


# -- one engine -------------------------------------------------------------------


@dataclass
class Transfer:
    """A transfer the machine can finish: an offloading job or a NIXL read."""

    engine: CrossHarness
    kind: str  # "store", "load" or "read"
    req_id: str
    job_id: int | None = None


class ConnectorView:
    """What s03's checks read of the scripted connector (`pending`, `stores`,
    `saving`, `offers`, `sync_loads`), from the real connectors' state."""

    def __init__(self, harness: CrossHarness) -> None:
        self.harness = harness
        # req_id -> the async load of its external tokens, until the
        # scheduler got finished_recving for it.
        self.pending: dict[str, Load] = {}
        # requests a connector claimed external tokens for
        self.offers: set[str] = set()
        self.sync_loads: dict[str, Load] = {}

    @property
    def stores(self) -> dict[str, set[int]]:
        """The blocks each request's stores read: the jobs the worker side
        still runs, and the store records OffloadingConnector's scheduler
        side keeps (what its `request_blocks_freed` holds); and on a P/D
        producer the blocks NixlConnector holds for the consumer's read
        (its `_window_holds`, what its `request_blocks_freed` holds); and the
        held blocks the scheduler asks about again with its next output
        (`KVCacheManager.held_to_ask_again`)."""
        out: dict[str, set[int]] = {}
        h = self.harness
        manager = h.scheduler.kv_cache_manager
        for req_id in manager.held_to_ask_again:
            out[req_id] = {b.block_id for b in manager.held_blocks.get(req_id, ())}
        if h.nixl is not None:
            for req_id, hold in h.nixl.connector_scheduler._window_holds.items():
                out.setdefault(req_id, set()).update(hold.held.values())
        if h.offload is None:
            return {r: b for r, b in out.items() if b}
        records = getattr(h.offload.connector_scheduler, "_store_batches", {})
        for req_id, batches in records.items():
            for batch in batches:
                out.setdefault(req_id, set()).update(batch.block_ids)
        jobs = h.offload_worker.connector_worker._jobs
        for job_id, spec in h.handler.pending.items():
            req_id, store = jobs[job_id]
            if store:
                out.setdefault(req_id, set()).update(NoCopyHandler.gpu_block_ids(spec))
        return {r: b for r, b in out.items() if b}

    @property
    def saving(self) -> dict[str, set[int]]:
        """Delayed frees: finished requests whose blocks a connector keeps."""
        scheduler = self.harness.scheduler
        tables = self.harness.tables()
        return {
            req_id: {
                b.block_id for g in tables.get(req_id, []) for b in g if not b.is_null
            }
            for req_id in s03.connector_state(scheduler, "sending")
        }


# The properties of s03's Harness checked on every engine (the others are
# about its scripted connector).
S03_PROPERTIES = (
    "Conservation",
    "ExclusiveOwnership",
    "NoTransferRace",
    "RefCount",
    "NullPrefix",
    "WindowBound",
    "ExactAdmission",
    "NoPrematurePublish",
    "InFlightRead",
    "StoreHold",
    "HoldPending",
    "LiveRecords",
)


class CrossHarness(s03.Harness):
    """One engine: its scheduler with the series' connectors' scheduler
    sides, their worker sides, a fake model runner, a router, and the checks
    (s03's on its state, and this machine's)."""

    def __init__(self, setup: CrossSetup, name: str, machine: CrossMachine):
        # s03.Harness.__init__ builds its own scheduler: this engine's instead,
        # and then the state of s03's checks (`_observe`).
        self.setup = setup
        self.name = name
        self.machine = machine
        self.kinds = setup.kinds
        self.vllm_config = self._vllm_config()
        self.kv_cache_config = KVCacheConfig(
            num_blocks=setup.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=make_kv_cache_groups(self.kinds, BLOCK_SIZE, setup.window),
        )
        self.scheduler = make_scheduler(
            self.vllm_config,
            self.kv_cache_config,
            scheduler_cls=AsyncScheduler if setup.async_scheduling else Scheduler,
        )
        assert self.scheduler.use_eagle == setup.eagle
        self.worker = worker_side(setup, self.vllm_config, self.kv_cache_config)
        subs = sub_connectors(self.scheduler.connector)
        self.offload = next(
            (c for c in subs if isinstance(c, OffloadingConnector)), None
        )
        self.nixl = next((c for c in subs if isinstance(c, NixlConnector)), None)
        workers = sub_connectors(self.worker)
        self.offload_worker = next(
            (c for c in workers if isinstance(c, OffloadingConnector)), None
        )
        self.nixl_worker = next(
            (c for c in workers if isinstance(c, ScriptedNixlWorker)), None
        )
        self.handler: NoCopyHandler | None = (
            self.offload_worker.connector_worker.spec.handler
            if self.offload_worker is not None
            else None
        )
        self.connector = ConnectorView(self)
        self._observe()
        # KV transfer params of the requests the engine finished with some
        self.transfer_params: dict[str, dict] = {}
        # blocks a producer's NixlConnector stopped holding at the finish
        self.nixl_dropped: dict[str, set[int]] = {}
        # requests a connector claimed external tokens for at a lookup
        self.external_hits: dict[str, int] = {}
        # requests that took a prefix cache hit at a lookup: tokens
        self.local_hits: dict[str, int] = {}
        self.router = Router()
        self.router.configure(self.kv_cache_config)
        # EvictionOrder: block id -> (request, leave number, group, -position)
        # of its last leave from a block table
        self.left: dict[int, tuple[str, int, int, int]] = {}
        self.num_leaves = 0
        self.releasing_held: tuple[str, ...] | None = None
        self._wrap_cross()
        _note("engine")

    def _vllm_config(self):
        setup = self.setup
        config = make_cpu_vllm_config(
            BLOCK_SIZE,
            setup.num_blocks,
            kv_transfer_config(setup, f"{self.name}-engine"),
            max_num_seqs=4,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            ),
        )
        if not setup.hma:
            config.scheduler_config.disable_hybrid_kv_cache_manager = True
        if setup.eagle:
            config.speculative_config = s03.speculative_config(
                setup.num_spec_tokens, eagle=True
            )
        return config

    # -- the machine's own checks, wrapped around the scheduler's calls
    def _wrap_cross(self) -> None:
        scheduler, manager, pool = self.scheduler, self.manager, self.pool
        coordinator = manager.coordinator

        publish = scheduler.kv_event_publisher.publish

        def published(batch):
            self._receive(batch.events)
            publish(batch)

        scheduler.kv_event_publisher.publish = published

        get_computed_blocks = manager.get_computed_blocks

        def lookup(request):
            self._flush_events()
            blocks, num_hit_tokens = get_computed_blocks(request)
            if num_hit_tokens:
                self.local_hits[request.request_id] = num_hit_tokens
            self._check_local_hit(request, num_hit_tokens)
            return blocks, num_hit_tokens

        manager.get_computed_blocks = lookup

        connector = scheduler.connector
        get_num_new_matched_tokens = connector.get_num_new_matched_tokens

        def matched(request, num_computed_tokens):
            ext, load_async = get_num_new_matched_tokens(request, num_computed_tokens)
            if ext:
                self.connector.offers.add(request.request_id)
                self.external_hits[request.request_id] = ext
            self._check_tier_hit(request, num_computed_tokens, ext or 0)
            return ext, load_async

        connector.get_num_new_matched_tokens = matched

        if self.offload is not None:
            off = self.offload
            # Kind 9's evidence: blocks a refused store evicted.
            self.evicted_by_refused_store: set = set()
            tier = off.connector_scheduler.manager
            prepare_store = tier.prepare_store

            def storing(block_hashes):
                block_hashes = list(block_hashes)
                before = set(self._tier_keys())
                out = prepare_store(block_hashes)
                if out is None:
                    gone = before - set(self._tier_keys())
                    if gone:
                        _note("a refused store evicted blocks")
                    self.evicted_by_refused_store |= gone
                return out

            tier.prepare_store = storing
            off_update = off.update_state_after_alloc

            def offload_alloc(request, blocks, num_external_tokens):
                if num_external_tokens:
                    self._check_offload_loadable(request, num_external_tokens)
                off_update(request, blocks, num_external_tokens)
                if num_external_tokens:
                    self._check_offload_load_covers(request, num_external_tokens)
                    self._record_load(request, num_external_tokens)

            off.update_state_after_alloc = offload_alloc

        if self.nixl is not None:
            nixl = self.nixl
            nixl_update = nixl.update_state_after_alloc

            def nixl_alloc(request, blocks, num_external_tokens):
                nixl_update(request, blocks, num_external_tokens)
                if num_external_tokens:
                    self._check_nixl_loadable(request, num_external_tokens)
                    self._record_load(request, num_external_tokens)

            nixl.update_state_after_alloc = nixl_alloc

            # Kind 11's evidence: the blocks a producer's NixlConnector stops
            # holding when the request finishes (held at a position where the
            # table has a real block), which the scheduler still holds.
            nixl_scheduler = nixl.connector_scheduler
            finished_all_groups = nixl_scheduler.request_finished_all_groups

            def nixl_finished(request, block_ids):
                hold = nixl_scheduler._window_holds.get(request.request_id)
                before = set(hold.held.values()) if hold is not None else set()
                out = finished_all_groups(request, block_ids)
                hold = nixl_scheduler._window_holds.get(request.request_id)
                after = set(hold.held.values()) if hold is not None else set()
                if before - after:
                    self.nixl_dropped.setdefault(request.request_id, set()).update(
                        before - after
                    )
                return out

            nixl_scheduler.request_finished_all_groups = nixl_finished

        # EvictionOrder: leaves from the tables, and releases to the queue.
        free, remove_skipped = coordinator.free, coordinator.remove_skipped_blocks

        def freeing(request_id):
            self._leave(request_id, self._table_positions(request_id))
            free(request_id)

        def removing(request_id, num_computed_tokens):
            self._leave(
                request_id, self._skipped_positions(request_id, num_computed_tokens)
            )
            return remove_skipped(request_id, num_computed_tokens)

        coordinator.free = freeing
        coordinator.remove_skipped_blocks = removing

        free_held = manager.free_held_blocks

        def releasing(*request_ids):
            self.releasing_held = request_ids
            try:
                free_held(*request_ids)
            finally:
                self.releasing_held = None

        manager.free_held_blocks = releasing

        free_blocks = pool.free_blocks

        def freed(ordered_blocks):
            blocks = list(ordered_blocks)
            free_blocks(blocks)
            self._check_eviction_order(
                [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
            )

        pool.free_blocks = freed

    def note_once(self, what: str) -> None:
        """Note `what` once per engine and example."""
        if what not in self.noted:
            self.noted.add(what)
            _note(what)

    # -- known failures and new kinds
    def violation(self, prop: str, message: str, kinds: tuple[int, ...], fatal: bool):
        """A property fails: with every kind of `kinds` expected, it is a
        known failure (recorded; `KnownFailure` if `fatal`); else the
        example fails. `kinds` empty: a new kind."""
        label = f"kind {', '.join(map(str, kinds))}" if kinds else "a new kind"
        text = f"{prop} violated: {message} ({label}, the {self.name})"
        if kinds and all(k in EXPECTED_FAILURES and not is_strict(k) for k in kinds):
            for k in kinds:
                KNOWN_SEEN[k] += 1
                KNOWN_FIRST.setdefault(k, f"{self.setup.label()}: {text}")
                self.machine.note_known(k)
            if fatal:
                raise KnownFailure(text)
            return
        raise AssertionError(text)

    # -- events and the router
    def _flush_events(self) -> None:
        """The events the engine has made and not published yet (a lookup
        sees the engine's state as of now)."""
        events = self.manager.take_events()
        events.extend(self.scheduler.connector.take_events())
        if events:
            self._receive(events)

    def _receive(self, events: list) -> None:
        decoded = self.router.receive(list(events))
        if decoded:
            _note("events received")
        self._check_events(decoded)

    def _check_events(self, decoded: list) -> None:
        """EventsNameBlockAndGroup."""
        for ev in decoded:
            if isinstance(ev, router_events.AllBlocksCleared):
                continue
            medium = ev.medium or "GPU"
            if medium != "GPU":
                self.note_once(f"events of the {medium} tier")
            problem = None
            if ev.group_idx is None:
                problem = "names no KV cache group"
            elif medium != "GPU":
                unknown = [
                    h
                    for h in ev.block_hashes
                    if (h, ev.group_idx) not in self.router.published
                ]
                if unknown:
                    problem = (
                        f"names blocks {unknown[:2]!r} the engine never published "
                        f"in group {ev.group_idx}"
                    )
            if problem is not None:
                self.violation(
                    "EventsNameBlockAndGroup",
                    f"a {type(ev).__name__} event of the {medium} medium {problem}",
                    (3,) if medium != "GPU" else (),
                    fatal=False,
                )

    def _tokens(self, request: Request) -> list[int]:
        return list(request.all_token_ids)

    def _check_local_hit(self, request: Request, num_hit_tokens: int) -> None:
        """RouterPredictsHit, the engine's prefix cache hit."""
        if num_hit_tokens:
            _note("local prefix cache hit")
        tokens = self._tokens(request)
        predicted = self.router.predict_local(tokens)
        self.lookup_local = (request.request_id, num_hit_tokens)
        if predicted == num_hit_tokens:
            return
        kinds: tuple[int, ...] = ()
        if self.setup.eagle and self.router.predict_local(tokens, rule_eagle=True) == (
            num_hit_tokens
        ):
            kinds = (4,)
        self.violation(
            "RouterPredictsHit",
            f"the router predicts a prefix cache hit of {predicted} tokens for "
            f"{request.request_id} ({len(tokens)} tokens), the engine hits "
            f"{num_hit_tokens}",
            kinds,
            fatal=False,
        )

    def _check_tier_hit(self, request: Request, num_computed: int, ext: int) -> None:
        """RouterPredictsHit, the tokens a connector's tier adds."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") or self.offload is None:
            if not params.get("do_remote_prefill") and ext:
                self.violation(
                    "RouterPredictsHit",
                    f"{request.request_id} gets {ext} external tokens from a "
                    "connector without a tier",
                    (),
                    fatal=False,
                )
            return
        if ext:
            _note("connector tier hit")
        tokens = self._tokens(request)
        truth = self._tier_truth()
        inexact = self._check_tier_events(truth)
        cpu = self.router.indexes.get("CPU")
        predicted = self.router.predict_tier(cpu, tokens, num_computed)
        if predicted == ext:
            return
        # The classification: the fixes that explain the claim (kind 3: the
        # tier's keys decoded; the tier's events exact; kind 4: the rule
        # with EAGLE).
        fixed = self.router.fixed.get("CPU")
        kinds: tuple[int, ...] = ()
        views = ((cpu, ()), (fixed, (3,)), (truth, (3, *inexact)))
        for view, view_kinds in views:
            if view is not cpu and (
                self.router.predict_tier(view, tokens, num_computed) == ext
            ):
                kinds = view_kinds
                break
            if (
                self.setup.eagle
                and self.router.predict_tier(
                    view, tokens, num_computed, loadable_with_eagle=True
                )
                == ext
            ):
                kinds = (*view_kinds, 4)
                break
        if (
            not kinds
            and ext < predicted
            and self.router.predict_tier(
                cpu, tokens, num_computed, last_block_everywhere=True
            )
            == ext
        ):
            kinds = (10,)
        if any(k is None for k in kinds):
            kinds = ()
        self.violation(
            "RouterPredictsHit",
            f"the router predicts {predicted} tokens of the CPU tier for "
            f"{request.request_id} after {num_computed} computed ones "
            f"({len(tokens)} tokens), the connector claims {ext}",
            kinds,
            fatal=False,
        )

    def _tier_keys(self) -> list:
        """The offloading manager's keys, ready or being stored."""
        manager = self.offload.connector_scheduler.manager
        if hasattr(manager, "blocks"):  # LRU
            return list(manager.blocks)
        return [*manager.t1, *manager.t2]  # ARC

    def _tier_truth(self) -> router_events.Index:
        """What the offloading manager holds, ready, as a router's index of
        the tier would hold it from exact events: (block hash as the engine
        publishes it, group)."""
        manager = self.offload.connector_scheduler.manager
        if hasattr(manager, "blocks"):  # LRU
            items = manager.blocks.items()
        else:  # ARC
            items = itertools.chain(manager.t1.items(), manager.t2.items())
        truth = router_events.Index()
        for key, block in items:
            if block.is_ready:
                h, g = _fixed_hash(key, 0)
                truth.groups.setdefault(g, router_events.Group("", 0)).holds().add(h)
        return truth

    def _check_tier_events(self, truth: router_events.Index) -> tuple:
        """TierEventsExact: the tier's events (keys decoded) say what the
        offloading manager holds. Returns the kinds of a known difference
        (recorded): (9,) for blocks ARC evicted for a store it then refused,
        with no BlockRemoved."""
        fixed = self.router.fixed.get("CPU")
        have = {
            (h, g)
            for g, group in (fixed.groups.items() if fixed is not None else ())
            for h in group.holds()
        }
        real = {(h, g) for g, group in truth.groups.items() for h in group.holds()}
        if have == real:
            return ()
        stale, unknown = have - real, real - have
        refused = {_fixed_hash(k, 0) for k in self.evicted_by_refused_store}
        kinds: tuple = (9,) if stale <= refused and not unknown else (None,)
        self.violation(
            "TierEventsExact",
            f"the CPU tier's events say it holds {len(stale)} (block hash, group) "
            f"it does not hold {sorted(stale)[:3]}, and not {len(unknown)} it "
            f"holds {sorted(unknown)[:3]}",
            () if None in kinds else kinds,
            fatal=False,
        )
        return kinds

    # -- LoadableHit
    def _external_positions(self, request: Request, num_external: int):
        """(group, position, block) of every real block of the external
        tokens in the request's tables."""
        tables = self.manager.get_blocks(request.request_id).blocks
        lookup_end = self._lookup_computed(request)
        first, end = (
            lookup_end // BLOCK_SIZE,
            cdiv(lookup_end + num_external, BLOCK_SIZE),
        )
        for g, table in enumerate(tables):
            for pos in range(first, min(end, len(table))):
                if not table[pos].is_null:
                    yield g, pos, table[pos]

    def _lookup_computed(self, request: Request) -> int:
        req_id, num_hit = getattr(self, "lookup_local", (None, 0))
        assert req_id == request.request_id, (req_id, request.request_id)
        return num_hit

    def _check_offload_loadable(self, request: Request, num_external: int) -> None:
        """LoadableHit (OffloadingConnector): every block the scheduler
        allocated for the external tokens is in the offloading manager,
        ready, under its group's key."""
        scheduler_side = self.offload.connector_scheduler
        manager = scheduler_side.manager
        hashes = request.block_hashes
        missing = []
        for g, pos, block in self._external_positions(request, num_external):
            if pos >= len(hashes):
                continue  # the last, partial block: computed, not loaded
            (key,) = scheduler_side._group_keys(request, g, pos, pos + 1)
            if manager.lookup([key]) != 1:
                missing.append((g, pos, block.block_id))
        if not missing:
            _note("loadable offloading hit")
            return
        num_computed = self._lookup_computed(request)
        hit = num_computed + num_external
        managers = self.manager.coordinator.single_type_managers
        kinds: tuple[int, ...] = ()
        # Kind 1: only blocks before those the window (or chunk) of the hit
        # reads, which the scheduler allocates with EAGLE.
        if self.setup.eagle and all(
            self.kinds[g] != "full"
            and pos < managers[g].get_num_skipped_tokens(hit) // BLOCK_SIZE
            for g, pos, _ in missing
        ):
            kinds = (1,)
        self.violation(
            "LoadableHit",
            f"OffloadingConnector claims {num_external} tokens of "
            f"{request.request_id} after {num_computed} computed ones; the "
            f"scheduler allocated blocks (group, position, block) {missing} "
            "for them, which the offloading manager does not hold",
            kinds,
            fatal=True,
        )

    def _check_offload_load_covers(self, request: Request, num_external: int):
        """LoadableHit (OffloadingConnector's load): the load of the claimed
        tokens writes, or reports as failed, exactly the real blocks the
        scheduler allocated for them in every group (a block allocated and
        neither loaded nor failed would be cached with KV nobody wrote)."""
        scheduler_side = self.offload.connector_scheduler
        req_id = request.request_id
        load = scheduler_side._reqs_to_load.get(req_id)
        written = set(NoCopyHandler.gpu_block_ids(load)) if load else set()
        failed = set(scheduler_side._load_errors.get(req_id, ()))
        num_hashes = len(request.block_hashes)
        allocated = {
            block.block_id
            for _, pos, block in self._external_positions(request, num_external)
            if pos < num_hashes
        }
        if written | failed == allocated:
            return
        self.violation(
            "LoadableHit",
            f"OffloadingConnector's load of {num_external} tokens of {req_id} "
            f"writes blocks {sorted(written)} and fails {sorted(failed)}; the "
            f"scheduler allocated {sorted(allocated)} for them",
            (1,) if self.setup.eagle and allocated > written | failed else (),
            fatal=False,
        )

    def _check_nixl_loadable(self, request: Request, num_external: int) -> None:
        """LoadableHit (NixlConnector as consumer): every local block read
        into gets the producer's block of the same group and position, which
        the producer holds for the request it names."""
        entry = self.nixl.connector_scheduler._reqs_need_recv.get(request.request_id)
        if entry is None:
            return
        params = request.kv_transfer_params or {}
        remote_req = params.get("remote_request_id")
        producer = self.machine.producer
        problems = []
        tables = self.manager.get_blocks(request.request_id).blocks
        positions = {
            (g, b.block_id): pos
            for g, table in enumerate(tables)
            for pos, b in enumerate(table)
            if not b.is_null
        }
        not_read: list[int] = []
        if len(entry) > 2:
            _, local, remote, not_read = entry
            if not_read:
                problems.append(
                    f"local blocks {sorted(not_read)[:4]} get no remote block "
                    "(failed loads)"
                )
            pairs = [
                (g, positions[(g, lb)], rb)
                for g in range(len(local))
                for lb, rb in zip(local[g], remote[g], strict=False)
            ]
        else:
            _, local = entry
            remote = params.get("remote_block_ids") or [[]]
            remote = remote[0] if remote and isinstance(remote[0], list) else remote
            tail = remote[-len(local) :] if local else []
            pairs = [
                (0, positions[(0, lb)], rb) for lb, rb in zip(local, tail, strict=False)
            ]
        theirs = producer.tables().get(remote_req) if producer is not None else None
        held = producer is not None and remote_req in s03.connector_state(
            producer.scheduler, "sending"
        )
        # The blocks the producer holds for the consumer's read where its
        # table has the null block (a window dropped them): (group,
        # position) -> block, each held by the producer's KV cache manager.
        window_held: dict[tuple[int, int], int] = {}
        if producer is not None:
            hold = producer.nixl.connector_scheduler._window_holds.get(remote_req)
            held_ids = {
                b.block_id for b in producer.manager.held_blocks.get(remote_req, ())
            }
            if hold is not None:
                window_held = {
                    place: b for place, b in hold.held.items() if b in held_ids
                }
        misread = []
        for g, pos, rb in pairs:
            if theirs is None or not held:
                problems.append(f"the producer holds no blocks for {remote_req}")
                break
            table = theirs[g]
            have = table[pos].block_id if pos < len(table) else None
            if pos < len(table) and table[pos].is_null:
                have = window_held.get((g, pos))
            if have != rb:
                misread.append(f"({g}, {pos}, {rb}, {have})")
        if misread:
            problems.append(
                "(group, position, remote block read, the producer's block at "
                f"that position): {', '.join(misread[:4])}"
            )
        if not problems:
            _note("loadable NIXL read")
            return
        kinds: tuple[int, ...] = ()
        if not_read and not misread and self.setup.eagle:
            kinds = (2,)
        elif misread and len(entry) == 2 and self.setup.eagle:
            kinds = (7,)
        self.violation(
            "LoadableHit",
            f"NixlConnector claims {num_external} tokens of {request.request_id} "
            f"(from {remote_req}): {'; '.join(problems[:3])}",
            kinds,
            fatal=False,
        )

    def _check_producer_offers(self, req_id: str) -> None:
        """ProducerOffersReads: a producer's request that computed its whole
        prompt (no prefix cache hit, no external tokens) offers, in its KV
        transfer params, a real block at every position of every group that
        the consumer's scheduler allocates when it loads the whole prompt (its
        `BlockTableLayout`, EAGLE as configured): the consumer reads them
        all and computes none of the prompt again."""
        consumer = self.machine.consumer
        params = self.transfer_params[req_id]
        remote = params.get("remote_block_ids")
        if consumer is None or self is consumer or not remote:
            return
        if (
            self.local_hits.get(req_id)
            or self.external_hits.get(req_id)
            or not isinstance(remote[0], list)
        ):
            return
        num_tokens = len(self.prompts[req_id][0])
        layout = BlockTableLayout(consumer.manager.coordinator)
        ranges = layout.get_external_block_ranges(num_tokens, 0, num_tokens)
        null_block_id = self.pool.null_block.block_id
        missing = [
            (g, pos)
            for g, positions in enumerate(ranges)
            for pos in positions
            if pos >= len(remote[g]) or remote[g][pos] == null_block_id
        ]
        if not missing:
            self.note_once("producer offers every block the consumer reads")
            return
        self.violation(
            "ProducerOffersReads",
            f"{req_id} ({num_tokens} tokens, computed whole) offers no block at "
            f"(group, position) {missing[:6]}, which the consumer reads "
            f"(remote_block_ids {remote})",
            (2,) if self.setup.eagle else (),
            fatal=False,
        )

    def _record_load(self, request: Request, num_external: int) -> None:
        start = self._lookup_computed(request)
        end = start + num_external
        tables = self.manager.get_blocks(request.request_id).blocks
        spans = [t[start // BLOCK_SIZE : cdiv(end, BLOCK_SIZE)] for t in tables]
        self.connector.pending[request.request_id] = Load(
            tuple([b.block_id for b in span if not b.is_null] for span in spans),
            True,
            start,
            end,
        )
        _note("async load started")

    # -- EvictionOrder
    def _table_positions(self, request_id: str) -> dict[int, tuple[int, int]]:
        managers = self.manager.coordinator.single_type_managers
        return {
            b.block_id: (g, pos)
            for g, m in enumerate(managers)
            for pos, b in enumerate(m.req_to_blocks.get(request_id, ()))
            if not b.is_null
        }

    def _skipped_positions(
        self, request_id: str, num_computed_tokens: int
    ) -> dict[int, tuple[int, int]]:
        """The blocks `remove_skipped_blocks` takes out of the tables."""
        out = {}
        for g, m in enumerate(self.manager.coordinator.single_type_managers):
            table = m.req_to_blocks.get(request_id, ())
            num_skipped = m.get_num_skipped_tokens(num_computed_tokens) // m.block_size
            for pos in range(min(num_skipped, len(table))):
                if not table[pos].is_null:
                    out[table[pos].block_id] = (g, pos)
        return out

    def _leave(self, request_id: str, leaving: dict[int, tuple[int, int]]) -> None:
        """Blocks about to leave the request's tables (one leave)."""
        if not leaving:
            return
        self.num_leaves += 1
        for b, (g, pos) in leaving.items():
            self.left[b] = (request_id, self.num_leaves, g, -pos)

    def _check_eviction_order(self, appended: list) -> None:
        """EvictionOrder, one free: the blocks one call appends to the free
        queue that last left the same request's tables come in 0.13.0's
        order (a release of held blocks: `_check_held_release`)."""
        if self.releasing_held is not None:
            return
        by_request: dict[str, list[tuple[int, int, int, int]]] = {}
        for b in appended:
            record = self.left.get(b.block_id)
            if record is not None:
                req_id, leave, g, neg_pos = record
                by_request.setdefault(req_id, []).append(
                    (leave, g, neg_pos, b.block_id)
                )
        for req_id, ranks in by_request.items():
            if len(ranks) > 1:
                self.note_once("several blocks of a request freed at once")
            if ranks != sorted(ranks):
                callers = " <- ".join(
                    f.name for f in reversed(traceback.extract_stack()[-7:-3])
                )
                self.violation(
                    "EvictionOrder",
                    f"blocks of {req_id} go back to the free queue as (leave, "
                    f"group, -position, block) {ranks}; an immediate free gives "
                    f"{sorted(ranks)} (freed by {callers})",
                    (),
                    fatal=False,
                )

    def _update_from_output(self, output, model_runner_output):
        """`update_from_output`, and EvictionOrder for the held blocks it
        releases (the only call that does): they enter the free queue one
        after the other, in the order in which they last left a block table
        (the definition of `hmastack_testkit.eviction_order`)."""
        manager = self.manager
        queue = self.pool.free_block_queue
        before = {b.block_id for b in queue.get_all_free_blocks()}
        held_before = {
            b.block_id for blocks in manager.held_blocks.values() for b in blocks
        }
        in_tables = {
            b.block_id
            for m in manager.coordinator.single_type_managers
            for table in m.req_to_blocks.values()
            for b in table
        }
        engine_outputs = self.scheduler.update_from_output(output, model_runner_output)
        entered = [
            b.block_id for b in queue.get_all_free_blocks() if b.block_id not in before
        ]
        released = [b for b in entered if b in held_before and b not in in_tables]
        if len(released) > 1:
            self.note_once("held blocks released together")
        places = [self.left.get(b, ("?", -1, 0, 0))[1:] for b in released]
        first = entered.index(released[0]) if released else 0
        if places != sorted(places) or (
            entered[first : first + len(released)] != released
        ):
            self.violation(
                "EvictionOrder",
                f"held blocks {released} enter the free queue as (leave, group, "
                f"-position) {places}; an immediate free gives {sorted(places)}, "
                f"one after the other (the blocks entering: {entered})",
                (5,),
                fatal=False,
            )
        return engine_outputs

    # -- actions
    def add(self, prompt: list[int], max_tokens: int, params: dict | None) -> str:
        req_id = f"{self.name[0]}{self.next_id}"
        self.next_id += 1
        request = s03.make_request(req_id, prompt, max_tokens)
        if params is not None:
            request.kv_transfer_params = params
        self.prompts[req_id] = (prompt, max_tokens)
        self.scheduler.add_request(request)
        return req_id

    def step(self, accept: int, eos_pick: int | None) -> None:
        scheduler = self.scheduler
        num_unfinished = scheduler.get_num_unfinished_requests()
        self.hits.clear()
        output = scheduler.schedule()
        if self.in_flight:
            _note("scheduled with a step in flight")
        if output.scheduled_spec_decode_tokens:
            _note("drafts scheduled")
        step = self._new_step(output, accept, eos_pick, None)
        self._read_and_write(step)
        self._execute(step)
        self.in_flight.append(step)
        self.check_all()
        if not self.setup.steps_in_flight or len(self.in_flight) > 1:
            self._process(self.in_flight.popleft())
        self.check_progress(
            bool(output.total_num_scheduled_tokens)
            or scheduler.get_num_unfinished_requests() < num_unfinished
        )

    def _first_read(self, group: int, start: int) -> int:
        """What the group's layers read before the token at `start` (a
        chunked local attention group: its chunk)."""
        managers = self.manager.coordinator.single_type_managers
        return managers[group].get_num_skipped_tokens(start)

    def _execute(self, step: s03.Step) -> None:
        """The model runner executes the step: the worker-side connector with
        the step's metadata, as vLLM's model runner drives it."""
        worker = self.worker
        worker.bind_connector_metadata(step.output.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(step.output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors() | self.invalid_block_ids
        self.invalid_block_ids = set()
        worker.clear_connector_metadata()
        step.kv_output = (set(sending or ()), set(recving or ()), invalid)
        self.finished_recving |= set(recving or ())

    def _process(self, step: s03.Step) -> None:
        """The model runner returns `step`'s output."""
        scheduler = self.scheduler
        sending, recving, invalid = step.kv_output
        if invalid:
            _note("load failure reported")
            self._invalidate(invalid)
        for req_id in recving:
            load = self.connector.pending.get(req_id)
            if load is not None:
                self._write_load(req_id, load, invalid)
        req_ids, sampled = self._sample(step)
        model_runner_output = self._model_runner_output(
            req_ids, sampled, sending, recving, invalid
        )
        engine_outputs = self._update_from_output(step.output, model_runner_output)
        for req_id in recving:
            self.connector.pending.pop(req_id, None)
            self.finished_recving.discard(req_id)
            _note("load finished")
        if sending:
            _note("finished_sending reported")
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.kv_transfer_params:
                    self.transfer_params[out.request_id] = dict(out.kv_transfer_params)
                    _note("KV transfer params given")
                    self._check_producer_offers(out.request_id)
        if any(
            r not in scheduler.requests or scheduler.requests[r].is_finished()
            for r in req_ids
        ):
            _note("request finished")
        self._propose_drafts(req_ids, sampled)

    def transfers_to_finish(self) -> list[Transfer]:
        out = []
        if self.handler is not None:
            jobs = self.offload_worker.connector_worker._jobs
            for job_id in sorted(self.handler.pending):
                req_id, store = jobs[job_id]
                out.append(Transfer(self, "store" if store else "load", req_id, job_id))
        if self.nixl_worker is not None:
            out += [Transfer(self, "read", r) for r in sorted(self.nixl_worker.reads)]
        return out

    def finish(self, transfer: Transfer, fail: int | None = None) -> None:
        """Finish a transfer; `fail` (a load or a read): it failed (an
        offloading load from its `fail`-th block on)."""
        if transfer.kind == "read":
            if fail is None:
                self.nixl_worker.finish_read(transfer.req_id)
                _note("NIXL read finished")
            else:
                self.nixl_worker.fail_read(transfer.req_id)
                _note("NIXL read failed")
            return
        spec = self.handler.finish(transfer.job_id)
        _note(f"offloading {transfer.kind} finished")
        if transfer.kind == "load" and fail is not None:
            blocks = NoCopyHandler.gpu_block_ids(spec)
            self.invalid_block_ids |= set(blocks[fail % len(blocks) :])
            _note("offloading load failed")

    # -- checks
    def check_all(self) -> None:
        checks = [(n, c) for n, c in self.safety_checks() if n in S03_PROPERTIES]
        assert len(checks) == len(S03_PROPERTIES), (
            "S03_PROPERTIES names a property the harness does not check"
        )
        for name, check in checks:
            try:
                check()
            except AssertionError as exc:
                self.violation(name, str(exc), self._classify(name, exc), fatal=False)
        if self.violations:
            raise AssertionError(f"{self.violations[0]} (a new kind, the {self.name})")

    def _classify(self, name: str, exc: AssertionError) -> tuple[int, ...]:
        """The known kind of a violation of one of s03's properties."""
        connector = self.scheduler.connector
        if name == "LiveRecords" and "nobody reads" in str(exc):
            req_id, _, rest = str(exc).partition(": held blocks ")
            unread = {int(b) for b in rest.split("]")[0].strip("[").split(", ")}
            if unread <= self.nixl_dropped.get(req_id, set()):
                return (11,)
            if req_id in getattr(connector, "_saving", {}):
                return (8,)
        return ()

    def check_window_bound(self, tables) -> None:
        """s03's WindowBound for the sliding window groups (a chunked local
        attention group holds the blocks of its chunk: checked by
        NullPrefix and Conservation only)."""
        kinds = self.kinds
        self.kinds = [k if k != "chunked_local" else "full" for k in kinds]
        try:
            super().check_window_bound(tables)
        finally:
            self.kinds = kinds


# -- the machine --------------------------------------------------------------------

# The last chunk of a directed prompt, in tokens: mostly around a block
# boundary, where the windows of two sides and of EAGLE's hit differ.
TAILS = st.sampled_from([1, 1, 2, 15, 16, 17]) | st.integers(1, 64)

request_args = st.fixed_dictionaries(
    dict(
        prefix=st.integers(0, len(PREFIX_BLOCKS) - 1),
        num_own=st.integers(1, 100),
        max_tokens=st.integers(1, 12),
        pd=st.booleans(),
        engine=st.integers(0, 1),
    )
)


class CrossMachine(RuleBasedStateMachine):
    """The engines of one `CrossSetup` (one, or a P/D pair), the rules that
    drive them and the invariants after every rule. `setup` is fixed per
    test (`machine_for`) or drawn (`setups`)."""

    setup: CrossSetup | None = None

    def __init__(self):
        super().__init__()
        self.engines: list[CrossHarness] = []
        self.producer: CrossHarness | None = None
        self.consumer: CrossHarness | None = None
        self.dead = False
        self.num_prompts = 0
        # producer request id -> its prompt, for forwarding
        self.forwarded: set[str] = set()
        self.expired: set[str] = set()
        self.link = PDLink()
        self.trace: list[str] = []

    def note_known(self, kind: int) -> None:
        _note(f"known failure: kind {kind}")

    def _start(self, setup: CrossSetup) -> None:
        self.setup = setup
        _note("example")
        if setup.pd:
            self.producer = CrossHarness(setup, "producer", self)
            self.consumer = CrossHarness(setup, "consumer", self)
            self.engines = [self.producer, self.consumer]
            self.link.producer = self.producer.nixl_worker
            self.producer.nixl_worker.link = self.link
            self.consumer.nixl_worker.link = self.link
        else:
            self.engines = [CrossHarness(setup, "engine", self)]

    def _run(self, what: str, action) -> None:
        """Run an action on the engines: NothingRaises, and the end of the
        example at a fatal known failure."""
        if self.dead:
            return
        try:
            action()
        except KnownFailure:
            self.dead = True
            _note("example ended at a known failure")
        except AssertionError as exc:
            if " violated: " in str(exc):
                raise
            self._raised(what, exc)
        except Exception as exc:  # noqa: BLE001 - every exception is a finding
            self._raised(what, exc)

    def _raised(self, what: str, exc: BaseException) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        where = " <- ".join(f"{f.name}" for f in reversed(frames[-4:]))
        names = {f.name for f in frames}
        kinds: tuple[int, ...] = ()
        if (
            self.setup.eagle
            and "prepare_load" in names
            and "_prepare_group_loads" in names
        ):
            kinds = (1,)
        text = (
            f"NothingRaises violated: {what} raised {type(exc).__name__}: {exc} "
            f"({where}) ({'kind 1' if kinds else 'a new kind'}, raised)"
        )
        if kinds and 1 in EXPECTED_FAILURES and not is_strict(1):
            KNOWN_SEEN[1] += 1
            KNOWN_FIRST.setdefault(1, f"{self.setup.label()}: {text}")
            self.dead = True
            return
        raise AssertionError(text) from exc

    def _prompt(self, prefix: int, num_own: int) -> list[int]:
        self.num_prompts += 1
        return s03.make_prompt(prefix, num_own, self.num_prompts)

    # -- rules (no preconditions: a rule with nothing to act on does nothing)
    def add(self, args: dict, prompt: list[int] | None = None) -> str | None:
        if prompt is None:
            prompt = self._prompt(args["prefix"], args["num_own"])
        if self.setup.pd and args["pd"]:
            engine, params, max_tokens = self.producer, {"do_remote_decode": True}, 1
        else:
            engine = self.engines[args["engine"] % len(self.engines)]
            params, max_tokens = None, args["max_tokens"]
        if len(engine.scheduler.requests) >= MAX_REQUESTS or self.dead:
            return None
        added: list[str] = []
        self._run(
            "add_request", lambda: added.append(engine.add(prompt, max_tokens, params))
        )
        return added[0] if added else None

    @rule(args=request_args)
    def add_request(self, args):
        self.add(args)

    @rule(args=request_args, pick=st.integers(0, 63))
    def resend(self, args, pick):
        """A prompt sent before, again (to any engine): it hits what the
        engines and their tiers kept of it."""
        prompts = sorted((e.name, r) for e in self.engines for r in e.prompts)
        if prompts:
            name, req_id = prompts[pick % len(prompts)]
            engine = next(e for e in self.engines if e.name == name)
            _note("prompt sent again")
            self.add(args, list(engine.prompts[req_id][0]))

    def _run_until_finished(self, engine: CrossHarness, req_id: str | None) -> None:
        """Steps of `engine` (at most 16) until `req_id` finished, every
        transfer finished after each."""
        for _ in range(16):
            request = engine.scheduler.requests.get(req_id)
            if req_id is None or request is None or request.is_finished():
                break
            self._run(f"step of the {engine.name}", lambda: engine.step(0, None))
            self.finish_all_transfers()
        self._run(f"drain of the {engine.name}", engine.drain)

    def _settle(self, engine: CrossHarness) -> None:
        """Steps of `engine` (at most 6) while it has requests or connector
        work, every transfer finished before each: holds and delayed frees
        end."""
        for _ in range(6):
            self.finish_all_transfers()
            if self.dead or not engine.scheduler.has_requests():
                break
            self._run(f"step of the {engine.name}", lambda: engine.step(0, None))
            self._run(f"drain of the {engine.name}", engine.drain)

    def _chunked_prompt(self, prefix: int, chunks: int, tail: int) -> list[int]:
        """A prompt of `chunks` token budgets plus `tail` tokens: a prefill
        whose last chunk is `tail` tokens (when it runs alone)."""
        length = chunks * self.setup.max_num_batched_tokens + tail
        shared = PREFIX_BLOCKS[prefix] * BLOCK_SIZE
        return self._prompt(prefix, max(1, length - shared))

    @rule(
        prefix=st.integers(0, len(PREFIX_BLOCKS) - 1),
        chunks=st.integers(0, 2),
        tail=TAILS,
        max_tokens=st.integers(1, 12),
        num_steps=st.integers(1, 4),
        read=st.sampled_from(["finish", "finish", "fail", None]),
    )
    def pd_round_trip(self, prefix, chunks, tail, max_tokens, num_steps, read):
        """A request through the P/D pair: prefilled by the producer in
        `chunks` full token budgets and a last chunk of `tail` tokens (until
        it finished, at most 12 steps), forwarded to the consumer, the
        consumer's steps, its read finished or failed."""
        if not self.setup.pd or self.dead:
            return
        prompt = self._chunked_prompt(prefix, chunks, tail)
        req_id = self.add(dict(pd=True, engine=0), prompt)
        producer = self.producer
        for _ in range(12):
            request = producer.scheduler.requests.get(req_id)
            if req_id in producer.transfer_params or request is None:
                break
            self._run("step of the producer", lambda: producer.step(0, None))
            self._run("drain of the producer", producer.drain)
        if req_id not in producer.transfer_params:
            return
        self.forward_request(req_id, max_tokens)
        consumer = self.consumer
        for _ in range(num_steps):
            self._run("step of the consumer", lambda: consumer.step(0, None))
            reads = [t for t in consumer.transfers_to_finish() if t.kind == "read"]
            if reads and read is not None:
                t = reads[-1]
                self._run(
                    f"{read} read",
                    lambda t=t: consumer.finish(t, fail=0 if read == "fail" else None),
                )

    @rule(
        prefix=st.integers(0, len(PREFIX_BLOCKS) - 1),
        chunks=st.integers(0, 2),
        tail=TAILS,
        num_fillers=st.integers(0, 3),
        engine=st.integers(0, 1),
    )
    def tier_round_trip(self, prefix, chunks, tail, num_fillers, engine):
        """A prompt computed and stored to the connector's tier; other
        prompts that evict it from the engine's prefix cache (`num_fillers`;
        none: the engine's prefix cache is reset, if nothing holds a block);
        and the prompt again: a hit of the tier (with what the engine still
        caches)."""
        if not self.setup.offloads or self.dead:
            return
        harness = self.engines[engine % len(self.engines)]
        args = dict(pd=False, engine=self.engines.index(harness), max_tokens=1)
        prompt = self._chunked_prompt(prefix, chunks, tail)
        self._run_until_finished(harness, self.add(args, prompt))
        for i in range(num_fillers):
            filler = self._chunked_prompt(0, chunks, 1 + (tail * (i + 3)) % 64)
            self._run_until_finished(harness, self.add(args, filler))
        if not num_fillers:
            self._settle(harness)
            self.reset_prefix_cache(engine)
        _note("prompt sent again after its tier stored it")
        self._run_until_finished(harness, self.add(args, list(prompt)))

    @rule(engine=st.integers(0, 1))
    def reset_prefix_cache(self, engine):
        """The engine's prefix cache is reset (`/reset_prefix_cache`): it
        succeeds when no request holds a block."""
        harness = self.engines[engine % len(self.engines)]
        done: list[bool] = []
        self._run(
            "reset_prefix_cache",
            lambda: done.append(harness.scheduler.reset_prefix_cache()),
        )
        if done and done[0]:
            _note("prefix cache reset")

    def forward_request(self, req_id: str, max_tokens: int) -> None:
        if len(self.consumer.scheduler.requests) >= MAX_REQUESTS or self.dead:
            return
        self.forwarded.add(req_id)
        prompt, _ = self.producer.prompts[req_id]
        params = dict(self.producer.transfer_params[req_id])
        _note("request forwarded to the consumer")
        self._run(
            "add_request (consumer)",
            lambda: self.consumer.add(list(prompt), max_tokens, params),
        )

    @rule(pick=st.integers(0, 7), max_tokens=st.integers(1, 12))
    def forward(self, pick, max_tokens):
        """The proxy sends a request the producer finished to the consumer,
        with the producer's KV transfer params."""
        if not self.setup.pd:
            return
        ready = sorted(
            r
            for r, params in self.producer.transfer_params.items()
            if r not in self.forwarded
            and r not in self.expired
            and params.get("do_remote_prefill")
        )
        if not ready:
            return
        self.forward_request(ready[pick % len(ready)], max_tokens)

    @rule(
        num_steps=st.integers(1, 6),
        engine=st.integers(0, 1),
        accept=st.integers(0, 3),
        eos_pick=st.none() | st.integers(0, 7),
    )
    def steps(self, num_steps, engine, accept, eos_pick):
        harness = self.engines[engine % len(self.engines)]
        for _ in range(num_steps):
            self._run(
                f"step of the {harness.name}", lambda: harness.step(accept, eos_pick)
            )

    @rule(engine=st.integers(0, 1))
    def drain(self, engine):
        harness = self.engines[engine % len(self.engines)]
        self._run(f"drain of the {harness.name}", harness.drain)

    def _transfers(self) -> list[Transfer]:
        return [t for e in self.engines for t in e.transfers_to_finish()]

    @rule(pick=st.integers(0, 15))
    def finish_transfer(self, pick):
        transfers = self._transfers()
        if transfers:
            t = transfers[pick % len(transfers)]
            self._run(f"finish {t.kind}", lambda: t.engine.finish(t))

    @rule(pick=st.integers(0, 15), first=st.integers(0, 7))
    def fail_transfer(self, pick, first):
        transfers = [t for t in self._transfers() if t.kind != "store"]
        if transfers:
            t = transfers[pick % len(transfers)]
            self._run(f"fail {t.kind}", lambda: t.engine.finish(t, fail=first))

    @rule(pick=st.integers(0, 7))
    def expire(self, pick):
        """The producer releases a finished request that no consumer reads
        any more (NIXL's timeout): one never forwarded, or whose consumer
        request finished reading."""
        if not self.setup.pd:
            return
        worker = self.producer.nixl_worker
        reading = {
            (self.consumer.scheduler.requests[r].kv_transfer_params or {}).get(
                "remote_request_id"
            )
            for r in self.consumer.scheduler.requests
        } | {
            meta.remote.request_id for meta in self.consumer.nixl_worker.reads.values()
        }
        candidates = sorted(
            r for r in worker.to_send if r not in reading and r not in self.expired
        )
        if candidates:
            req_id = candidates[pick % len(candidates)]
            self.expired.add(req_id)
            worker.expire(req_id)
            _note("producer request expired")

    @rule()
    def finish_all_transfers(self):
        for t in self._transfers():
            self._run(f"finish {t.kind}", lambda t=t: t.engine.finish(t))

    @rule(pick=st.integers(0, 63))
    def abort(self, pick):
        """An abort (one draw in four: most requests run to their end)."""
        if pick % 4:
            return
        pick //= 4
        live = [
            (e, r)
            for e in self.engines
            for r, req in sorted(e.scheduler.requests.items())
            if not req.is_finished()
        ]
        if live:
            engine, req_id = live[pick % len(live)]
            _note("abort")
            self._run(
                "abort",
                lambda: engine.scheduler.finish_requests(
                    req_id, RequestStatus.FINISHED_ABORTED
                ),
            )

    @invariant()
    def safety(self):
        if self.dead or not self.engines:
            return
        for engine in self.engines:
            self._run(f"checks of the {engine.name}", engine.check_all)

    def teardown(self):
        for engine in self.engines:
            for c in sub_connectors(engine.scheduler.connector):
                if isinstance(c, NixlConnector):
                    c.shutdown()


# What each example draws beyond its cell of the cross product.
sizes = st.fixed_dictionaries(
    dict(
        window=st.sampled_from([32, 64]),
        num_blocks=st.sampled_from([24, 32, 48, 72]),
        num_cpu_blocks=st.sampled_from([16, 32, 64]),
        max_num_batched_tokens=st.sampled_from([64, 64, 128]),
        fail_policy=st.sampled_from(["recompute", "recompute", "fail"]),
    )
)


def machine_for(setup: CrossSetup | None) -> type[CrossMachine]:
    """A `CrossMachine` class for one cell of the cross product (`setup`;
    the sizes drawn per example), or for cells drawn per example (None)."""
    cells = st.just(setup) if setup is not None else st.sampled_from(all_setups())

    class Machine(CrossMachine):
        @initialize(
            cell=cells,
            size=sizes,
            first=st.lists(request_args, min_size=1, max_size=3),
        )
        def start(self, cell, size, first):
            self._start(dataclasses.replace(cell, **size))
            for args in first:
                self.add(args)

    label = setup.label() if setup is not None else "drawn"
    Machine.__name__ = f"CrossMachine_{label.replace('-', '_')}"
    return Machine
