"""A random state machine over the real Scheduler with a Mamba hybrid layout.

One full attention and one Mamba KV cache group (16-token blocks, prefix
caching on), the testkit's scripted connector declaring Mamba support: the
machine adds requests whose first tokens the connector holds (loaded
synchronously or asynchronously, a whole prompt as a P/D consumer's, or
part of one), schedules steps whose output a fake model runner returns,
finishes and fails loads (of the Mamba state block or of an attention
block) and aborts requests. Every example starts with a P/D consumer's
request whose prompt ends on a block boundary, and finishes its load. After
every step:

* ``MambaTable``: a Mamba group's block table is null blocks, then real
  blocks: the state block(s) and the blocks of the tokens since.
* ``MambaPeak``: right after a new request's first allocation, its Mamba
  group holds the physical minimum: the block of the state after its last
  computed token (prefix cache hit and external tokens) and the blocks of
  the tokens it computes in the step; ``ExternalAligned``: the external
  computed tokens end on a Mamba block boundary.
* ``ValidState``: a request that has computed tokens holds, in its Mamba
  group, a real block that holds the state after its last computed token:
  a failed state load makes it compute again from a valid state (here: from
  the start, the Mamba group holding no earlier state). The machine follows
  what each Mamba block holds: a step that computes tokens writes, into the
  block of each token, the state after the last of them in the block; a
  load writes the state after the block's last token (what a connector
  stores); a failed load and a new allocation leave a block without a state.
  ``ValidStateRead``: each step also reads, for every request it computes
  from a token ``s > 0``, the state after token ``s - 1`` from its block.

The witnesses: with ``can_recompute_from`` asking the full attention group
only, a failed load leaves a request resuming from a state no block holds;
with external computed tokens that end between Mamba block boundaries, or
at the request's last token (which it then computes again from the state
before it), the request reads a state block that holds the state after
another token; ``ValidState`` or ``ValidStateRead`` fails.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hmastack_testkit import kvtest
from hmastack_testkit import scripted_connector as scripted
from hmastack_testkit.kv_layouts import make_cpu_vllm_config, make_kv_cache_groups
from hmastack_testkit.kvtest import (
    example_settings,
    model_runner_output,
)
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

BLOCK_SIZE = 16
KINDS = ["full", "mamba"]
# What the examples exercised (test_coverage).
COVERAGE: Counter[str] = Counter()
MAMBA = KINDS.index("mamba")
EOS = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MambaScriptedConnector(scripted.HoldingScriptedConnector):
    """The scripted connector, declaring that it stores and loads Mamba
    states (as NixlConnector and OffloadingConnector do)."""

    @classmethod
    def supports_mamba_with_config(cls, kv_transfer_config) -> bool:
        return True


NAME = "HmastackMambaScriptedConnector"
if NAME not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(
        NAME, __name__, MambaScriptedConnector.__name__
    )


@dataclass(frozen=True)
class Setup:
    num_blocks: int
    max_num_batched_tokens: int
    fail_policy: str


def make_scheduler(setup: Setup) -> Scheduler:
    vllm_config = make_cpu_vllm_config(
        BLOCK_SIZE,
        setup.num_blocks,
        KVTransferConfig(
            kv_connector=NAME,
            kv_role="kv_both",
            kv_load_failure_policy=setup.fail_policy,
        ),
        max_num_seqs=4,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=2048,
    )
    scheduler = kvtest.make_scheduler(
        vllm_config,
        KVCacheConfig(
            num_blocks=setup.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=make_kv_cache_groups(KINDS, BLOCK_SIZE, None),
        ),
    )
    assert type(scheduler.connector) is MambaScriptedConnector
    return scheduler


class Harness:
    """The scheduler, its connector, a fake model runner and the checks."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.scheduler = make_scheduler(setup)
        self.connector: MambaScriptedConnector = self.scheduler.connector  # type: ignore[assignment]
        self.manager = self.scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.next_id = 0
        self.last_prompt: list[int] = []
        self.prompts: dict[str, list[int]] = {}
        self.finished_recving: set[str] = set()
        self.invalid_block_ids: set[int] = set()
        # Mamba block id -> the token after which it holds the state (none:
        # a new block, or one a failed load left invalid).
        self.states: dict[int, int] = {}
        self.violations: list[str] = []
        self._wrap()

    def _wrap(self) -> None:
        manager, pool = self.manager, self.pool
        allocate_slots, get_new_blocks = manager.allocate_slots, pool.get_new_blocks

        def allocating(num_blocks):
            blocks = get_new_blocks(num_blocks)
            for b in blocks:
                self.states.pop(b.block_id, None)
            return blocks

        def measured(request, num_new_tokens, num_new_computed_tokens=0, *args, **kw):
            first = (
                request.request_id
                not in manager.coordinator.single_type_managers[MAMBA].req_to_blocks
            )
            blocks = allocate_slots(
                request, num_new_tokens, num_new_computed_tokens, *args, **kw
            )
            external = kw.get("num_external_computed_tokens", 0)
            if blocks is not None and first and external:
                COVERAGE["external tokens allocated"] += 1
                if num_new_computed_tokens:
                    COVERAGE["prefix cache hit and external tokens"] += 1
            if blocks is not None and first:
                self.check_peak(
                    request, num_new_computed_tokens, num_new_tokens, external
                )
            return blocks

        pool.get_new_blocks = allocating
        manager.allocate_slots = measured

    # -- actions
    def add_request(
        self,
        num_prompt: int,
        num_external: int,
        load_async: bool,
        max_tokens: int,
        after: int | None = None,
    ) -> str:
        """A request whose first `num_external` tokens the connector holds;
        with `after`, its prompt starts with that of a finished request
        (picked by `after`), whose blocks may be prefix cache hits."""
        req_id = f"r{self.next_id}"
        self.next_id += 1
        finished = [
            prompt
            for r, prompt in self.prompts.items()
            if r not in self.scheduler.requests
        ]
        # Distinct prompts, except that every third one starts with the prompt
        # before it (a prefix cache hit, and external tokens past it).
        prompt = [3000 + 100 * self.next_id + i for i in range(num_prompt)]
        if self.next_id % 3 == 0:
            prompt = self.last_prompt + prompt
        if after is not None and finished:
            prompt = finished[after % len(finished)] + prompt
        self.last_prompt = prompt
        self.prompts[req_id] = prompt
        self.connector.offers[req_id] = scripted.Offer(
            num_external, load_async, whole_prompt=load_async
        )
        self.scheduler.add_request(
            kvtest.make_request(req_id, prompt, BLOCK_SIZE, max_tokens, EOS)
        )
        return req_id

    def step(self, fail_sync: int | None) -> None:
        scheduler, connector = self.scheduler, self.connector
        connector.sync_loads = {}
        output = scheduler.schedule()
        invalid = set(self.invalid_block_ids)
        self.invalid_block_ids.clear()
        if connector.sync_loads:
            COVERAGE["sync load"] += 1
        if fail_sync is not None and connector.sync_loads:
            loads = sorted(connector.sync_loads)
            load = connector.sync_loads[loads[fail_sync % len(loads)]]
            groups = [g for g in load.block_ids if g]
            if groups:
                group = groups[fail_sync % len(groups)]
                invalid.add(group[fail_sync % len(group)])
                COVERAGE["sync load failed"] += 1
        # The synchronous loads write their blocks ahead of the step, the
        # asynchronous loads it reports before the next one.
        for req_id, load in connector.sync_loads.items():
            self.write_loaded(req_id, load, invalid)
        for req_id in self.finished_recving:
            if req_id in connector.pending:
                self.write_loaded(req_id, connector.pending[req_id], invalid)
        for block_id in invalid:
            self.states.pop(block_id, None)
        # The step reads the state after the token before the first it
        # computes, and writes the state after the last token it computes in
        # each block into that block (not into one a failed load of this step
        # left invalid).
        for req_id, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            end = request.num_computed_tokens
            table = self.mamba_table(req_id)
            self.check_read(req_id, table, end - n, invalid)
            for i in range((end - n) // BLOCK_SIZE, cdiv(end, BLOCK_SIZE)):
                b = table[i]
                if not b.is_null and b.block_id not in invalid:
                    self.states[b.block_id] = min(end, (i + 1) * BLOCK_SIZE) - 1
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            # A request past its prompt samples a token (not EOS: it finishes
            # at its max_tokens).
            sampled.append([5] if done else [])
        kv_output = KVConnectorOutput(
            finished_recving=set(self.finished_recving),
            invalid_block_ids=invalid,
        )
        self.finished_recving.clear()
        scheduler.update_from_output(
            output,
            model_runner_output(
                req_ids,
                sampled,
                kv_connector_output=kv_output,
            ),
        )

    def write_loaded(self, req_id: str, load: scripted.Load, invalid: set[int]) -> None:
        """A load writes into each Mamba block the state after the block's
        last token (a failed load: none)."""
        table = {b.block_id: i for i, b in enumerate(self.mamba_table(req_id))}
        for block_id in load.block_ids[MAMBA]:
            if block_id not in invalid and block_id in table:
                self.states[block_id] = (table[block_id] + 1) * BLOCK_SIZE - 1

    def mamba_table(self, req_id: str) -> list:
        mamba = self.manager.coordinator.single_type_managers[MAMBA]
        return mamba.req_to_blocks.get(req_id, [])

    def loads_to_report(self) -> list[str]:
        return sorted(set(self.connector.pending) - self.finished_recving)

    def finish_load(self, pick: int, fail_group: int | None, first: int) -> None:
        loads = self.loads_to_report()
        req_id = loads[pick % len(loads)]
        COVERAGE["async load finished"] += 1
        request = self.scheduler.requests.get(req_id)
        offer = self.connector.offers[req_id]
        if (
            fail_group is None
            and request is not None
            and offer.whole_prompt
            and offer.tokens >= request.num_prompt_tokens
            and request.num_prompt_tokens % BLOCK_SIZE == 0
        ):
            COVERAGE["async load of a whole prompt ending on a boundary finished"] += 1
        if fail_group is not None:
            groups = [g for g in self.connector.pending[req_id].block_ids if g]
            if groups:
                group = groups[fail_group % len(groups)]
                self.invalid_block_ids |= set(group[first % len(group) :])
                mamba_blocks = self.connector.pending[req_id].block_ids[MAMBA]
                if set(group[first % len(group) :]) & set(mamba_blocks):
                    COVERAGE["async load of a Mamba state block failed"] += 1
                else:
                    COVERAGE["async load of attention blocks failed"] += 1
        self.finished_recving.add(req_id)

    def fail_state_load(self, pick: int) -> None:
        """An asynchronous load that fails to write its Mamba state block."""
        loads = self.loads_to_report()
        req_id = loads[pick % len(loads)]
        state_blocks = self.connector.pending[req_id].block_ids[MAMBA]
        if state_blocks:
            COVERAGE["async load of a Mamba state block failed"] += 1
            self.invalid_block_ids |= set(state_blocks)
        self.finished_recving.add(req_id)

    def abort(self, pick: int) -> None:
        live = sorted(
            r for r, req in self.scheduler.requests.items() if not req.is_finished()
        )
        if live:
            self.scheduler.finish_requests(
                live[pick % len(live)], RequestStatus.FINISHED_ABORTED
            )

    # -- checks
    def check_peak(
        self, request, num_hit_tokens: int, num_new_tokens: int, external: int
    ) -> None:
        """MambaPeak and ExternalAligned, right after a new request's first
        allocation (its prefix cache hit, its external tokens and the tokens
        it computes in the step)."""
        computed = request.num_computed_tokens + num_hit_tokens + external
        offer = self.connector.offers[request.request_id]
        if 0 < external < offer.tokens - num_hit_tokens:
            COVERAGE["external tokens shortened to a Mamba block boundary"] += 1
        if external and computed % BLOCK_SIZE:
            self.violations.append(
                f"ExternalAligned violated: {request.request_id} computed "
                f"tokens end at {computed} with {external} external"
            )
        skipped = max(0, min(computed, request.num_tokens - 1) - 1) // BLOCK_SIZE
        want = cdiv(computed + num_new_tokens, BLOCK_SIZE) - skipped
        table = self.manager.coordinator.single_type_managers[MAMBA].req_to_blocks[
            request.request_id
        ]
        got = sum(not b.is_null for b in table)
        if got != want:
            self.violations.append(
                f"MambaPeak violated: {request.request_id} holds {got} Mamba "
                f"blocks for {computed} computed and {num_new_tokens} new tokens "
                f"(the minimum is {want})"
            )

    def check_read(self, req_id: str, table: list, start: int, invalid: set[int]):
        """ValidStateRead: a step that computes a request's tokens from
        `start` on reads the state after token `start - 1` (unless a failed
        load of the step left that block invalid: the scheduler then discards
        the step's tokens, and ValidState checks where the request goes
        on)."""
        if start == 0:
            return
        pos = (start - 1) // BLOCK_SIZE
        state = table[pos] if pos < len(table) else None
        if state is None or state.is_null:
            self.violations.append(
                f"ValidStateRead violated: {req_id} computes from token {start} "
                f"and holds no block of the state after token {start - 1}"
            )
        elif state.block_id not in invalid and (
            self.states.get(state.block_id) != start - 1
        ):
            self.violations.append(
                f"ValidStateRead violated: {req_id} computes from token {start} "
                f"on the state block {state.block_id}, which holds the state "
                f"after token {self.states.get(state.block_id)} (none: no "
                f"state), not after token {start - 1}"
            )

    def check_all(self) -> None:
        for req_id, request in self.scheduler.requests.items():
            table = self.mamba_table(req_id)
            nulls = [b.is_null for b in table]
            first_real = nulls.index(False) if False in nulls else len(nulls)
            assert not any(nulls[first_real:]), (
                f"MambaTable violated: {req_id} {[b.block_id for b in table]}"
            )
            c = request.num_computed_tokens
            if (
                c == 0
                or request.is_finished()
                or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ):
                continue
            pos = (c - 1) // BLOCK_SIZE
            state = table[pos] if pos < len(table) else None
            assert state is not None and not state.is_null, (
                f"ValidState violated: {req_id} has computed {c} tokens and "
                f"holds no block of the state after token {c - 1}"
            )
            assert self.states.get(state.block_id) == c - 1, (
                f"ValidState violated: {req_id} has computed {c} tokens on the "
                f"state block {state.block_id}, which holds the state after token "
                f"{self.states.get(state.block_id)} (none: no state, e.g. a "
                f"failed load left it invalid)"
            )
        assert not self.violations, self.violations


setups = st.builds(
    Setup,
    num_blocks=st.integers(24, 80),
    max_num_batched_tokens=st.sampled_from([64, 128, 512]),
    fail_policy=st.just("recompute"),
)

request_args = st.fixed_dictionaries(
    dict(
        num_prompt=st.integers(1, 200),
        num_external=st.sampled_from([0, 16, 40, 64, 100, 160, 240]),
        load_async=st.booleans(),
        max_tokens=st.integers(1, 8),
        after=st.none() | st.integers(0, 7),
    )
)


class MambaSchedulerMachine(RuleBasedStateMachine):
    harness: Harness

    @initialize(
        setup=setups,
        consumer_blocks=st.integers(2, 12),
        first=st.lists(request_args, max_size=3),
    )
    def start(self, setup, consumer_blocks, first):
        """Every example starts with a P/D consumer's request whose prompt
        ends on a block boundary and whose load finishes in its first two
        steps: the connector has the whole prompt, and the request computes
        its last token again from the state before it, which the block of
        that token does not hold (it holds the state after it)."""
        self.harness = Harness(setup)
        consumer = self.harness.add_request(
            num_prompt=consumer_blocks * BLOCK_SIZE,
            num_external=consumer_blocks * BLOCK_SIZE,
            load_async=True,
            max_tokens=4,
        )
        for args in first:
            self.harness.add_request(**args)
        self.harness.step(None)
        self.harness.check_all()
        loads = self.harness.loads_to_report()
        if consumer in loads:
            self.harness.finish_load(loads.index(consumer), None, 0)
        self.harness.step(None)
        self.harness.check_all()

    @rule(args=request_args)
    def add_request(self, args):
        if len(self.harness.scheduler.requests) < 6:
            self.harness.add_request(**args)

    @rule(num_steps=st.integers(1, 4), fail_sync=st.none() | st.integers(0, 63))
    def steps(self, num_steps, fail_sync):
        for i in range(num_steps):
            self.harness.step(fail_sync if i == 0 else None)
            self.harness.check_all()

    @rule(
        pick=st.integers(0, 7),
        fail_group=st.none() | st.integers(0, 3) | st.integers(0, 3),
        first=st.integers(0, 15),
    )
    def finish_load(self, pick, fail_group, first):
        if self.harness.loads_to_report():
            self.harness.finish_load(pick, fail_group, first)

    @rule(pick=st.integers(0, 7))
    def fail_state_load(self, pick):
        if self.harness.loads_to_report():
            self.harness.fail_state_load(pick)

    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        self.harness.abort(pick)

    @invariant()
    def safety(self):
        self.harness.check_all()


# A fixed, derandomized set of examples; a larger run with a fresh random seed
# each time: HMASTACK_RANDOM_EXAMPLES=N (and HMASTACK_RANDOM_STEPS=N, the
# rules per example), as the machine of the connector requests' stage. An
# example takes a few tens of milliseconds: 100 of them cover every path of
# REQUIRED_COVERAGE several times.
FIXED_EXAMPLES = 100
SETTINGS = example_settings(FIXED_EXAMPLES, steps=30)

MambaSchedulerMachine.TestCase.settings = SETTINGS
test_mamba_scheduler_state_machine = MambaSchedulerMachine.TestCase


REQUIRED_COVERAGE = (
    "external tokens allocated",
    "prefix cache hit and external tokens",
    "external tokens shortened to a Mamba block boundary",
    "sync load",
    "sync load failed",
    "async load finished",
    "async load of a whole prompt ending on a boundary finished",
    "async load of a Mamba state block failed",
    "async load of attention blocks failed",
)


def test_coverage():
    """The fixed set exercised every path of REQUIRED_COVERAGE (the counts
    of the machine's examples in this process; run after the machine)."""
    if not COVERAGE:
        test_mamba_scheduler_state_machine("runTest").runTest()
    print(dict(COVERAGE))
    missing = [what for what in REQUIRED_COVERAGE if not COVERAGE[what]]
    assert not missing, missing
