"""Stage 03b: the rules of the stateful random test of the real `Scheduler`
(`SchedulerMachine`), which hypothesis runs over the harness of
`hmastack_testkit.scheduler_machine` (its setups, connectors and the
invariants it checks after every rule and in the middle of each step).

Rules: add a request (shared prefixes give local prefix cache hits, so load
failures hit shared blocks; the connector holds an external prefix, loaded
synchronously or asynchronously), run engine steps (`schedule`, a fake model
runner output with sampled and accepted draft tokens, EOS or max_tokens,
`update_from_output`, new draft tokens), finish an async load
(`finished_recving`), fail a load (`invalid_block_ids`, async or sync), abort
a request, report a store (`finished_sending`), and `fail_sync_load`: a
request with a sync load that mostly fails when its step returns, preempted
for memory (the pool is short of blocks for every running request's
allocation that takes any) or aborted while that step is in flight, and its
prompt sent again afterwards.

Hypothesis derives the derandomized examples of the fixed set from the
source of `SchedulerMachine`: a change to the class's text changes which
examples CI runs (and `test_coverage` may then miss a path).
"""

from __future__ import annotations

import dataclasses

from hmastack_testkit.scheduler_machine import (
    PLAIN_LAYOUTS,
    PREFIX_BLOCKS,
    Harness,
    Setup,
    _note,
    check_mamba_rejected,
)
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

setups = st.builds(
    Setup,
    # Layouts with HMA on twice as often as the two with HMA off: most of the
    # series' rules (null prefix, window bound, per-group loads) are theirs.
    layout=st.sampled_from(["gemma3_like", "gpt_oss_like"] * 2 + sorted(PLAIN_LAYOUTS)),
    window=st.sampled_from([32, 64]),
    num_blocks=st.integers(16, 72),
    num_spec_tokens=st.sampled_from([0, 0, 2, 3]),
    eagle=st.booleans(),
    max_num_batched_tokens=st.sampled_from([64, 128, 512]),
    fail_policy=st.sampled_from(["recompute", "recompute", "fail"]),
    async_scheduling=st.booleans(),
    batch_queue=st.booleans(),
).map(
    lambda setup: dataclasses.replace(
        setup,
        batch_queue=setup.batch_queue
        and not setup.async_scheduling
        and not setup.num_spec_tokens,
    )
)

request_args = st.fixed_dictionaries(
    dict(
        prefix=st.integers(0, len(PREFIX_BLOCKS) - 1),
        num_own=st.integers(1, 120),
        num_external=st.sampled_from([0, 0, 16, 40, 64, 100, 160, 240]),
        load_async=st.booleans(),
        max_tokens=st.integers(1, 12),
        save=st.booleans(),
    )
)

# A request whose external tokens load synchronously (`fail_sync_load`):
# prompts that end at a block boundary or run past the token budget need a
# block in the step after the load's (a decode with a step in flight, or the
# next chunk of the prompt), so that a pool short of blocks preempts them.
sync_load_args = st.fixed_dictionaries(
    dict(
        prefix=st.integers(0, len(PREFIX_BLOCKS) - 1),
        num_own=st.sampled_from([16, 32, 48, 96, 112]) | st.integers(1, 120),
        num_external=st.sampled_from([16, 40, 64, 100, 160]),
        load_async=st.just(False),
        max_tokens=st.integers(1, 12),
        save=st.booleans(),
    )
)


class SchedulerMachine(RuleBasedStateMachine):
    """Rules without preconditions (a rule with nothing to act on does
    nothing): hypothesis gives up an example when several draws in a row hit
    disabled rules."""

    harness: Harness

    @initialize(setup=setups, first=st.lists(request_args, min_size=1, max_size=4))
    def start(self, setup, first):
        check_mamba_rejected(setup)
        self.harness = Harness(setup)
        if setup.async_scheduling:
            _note("async scheduling")
        if setup.batch_queue:
            _note("batch queue")
        for args in first:
            self.harness.add_request(**args)

    @rule(args=request_args)
    def add_request(self, args):
        if len(self.harness.scheduler.requests) < 8:
            self.harness.add_request(**args)

    @rule(
        num_steps=st.integers(1, 4),
        accept=st.integers(0, 3),
        eos_pick=st.none() | st.integers(0, 7),
        fail_sync=st.none() | st.integers(0, 63),
        fail_left=st.none() | st.integers(0, 63),
    )
    def steps(self, num_steps, accept, eos_pick, fail_sync, fail_left):
        """Engine steps; the first may fail the sync loads it starts, each may
        fail the sync load of a request preempted or aborted while that load
        is in flight."""
        for i in range(num_steps):
            self.harness.step(
                accept, eos_pick, fail_sync if i == 0 else None, fail_left
            )
            self.harness.check_all()

    @rule()
    def drain(self):
        """The model runner returns every step in flight (async scheduling)."""
        self.harness.drain()

    @rule(pick=st.integers(0, 7))
    def finish_load(self, pick):
        if self.harness.loads_to_report():
            self.harness.finish_load(pick)

    @rule(pick=st.integers(0, 7), group=st.integers(0, 5), first=st.integers(0, 15))
    def fail_load(self, pick, group, first):
        if self.harness.loads_to_report():
            self.harness.fail_load(pick, group, first)

    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        if any(not r.is_finished() for r in self.harness.scheduler.requests.values()):
            self.harness.abort(pick)

    @rule(pick=st.integers(0, 7))
    def abort_load_in_flight(self, pick):
        """An abort while a step that loads the request's external tokens
        synchronously is in flight (async scheduling); the next `steps` may
        fail that load."""
        if self.harness.loads_in_flight():
            self.harness.abort_load_in_flight(pick)

    @rule(
        args=sync_load_args,
        # Mostly a failing load.
        fail=st.integers(0, 63) | st.integers(0, 63) | st.none(),
        leaves=st.sampled_from([None, "memory", "memory", "abort"]),
        again=st.booleans(),
        num_steps=st.integers(2, 4),
    )
    def fail_sync_load(self, args, fail, leaves, again, num_steps):
        """A request loads its external tokens synchronously and the load may
        fail when its step returns; with steps in flight, the request may be
        preempted for memory or aborted while that step is in flight; its
        prompt may be sent again once that step returned (ValidHit,
        InvalidHit, InvalidOutput, Recached)."""
        if len(self.harness.scheduler.requests) < 8:
            self.harness.fail_sync_load(args, fail, leaves, again, num_steps)

    @rule(pick=st.integers(0, 7))
    def finish_save(self, pick):
        if self.harness.stores_to_report():
            self.harness.finish_save(pick)

    @invariant()
    def safety(self):
        self.harness.check_all()
