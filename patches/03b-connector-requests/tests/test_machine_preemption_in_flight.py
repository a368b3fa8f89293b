"""Stage 03, shrunk schedules of the random `Scheduler` test
(`hmastack_testkit.scheduler_machine`): a request preempted (for memory, or by a
load failure reported a step late) while a step that loads or
computes on a synchronous load is in flight, and that load fails:
no token of that step is emitted (InvalidOutput), nothing computed on
the failed KV stays a prefix cache hit (InvalidHit, ValidHit), and
the request is scheduled again (LiveRecords).
"""

from __future__ import annotations

import pytest
from hmastack_testkit.scheduler_machine import (
    Harness,
    Setup,
    connector_state,
    req_args,
)
from machine_rules import SchedulerMachine


@pytest.mark.parametrize("layout", ["gpt_oss_like", "gemma3_like"])
@pytest.mark.parametrize("scheduling", ["async", "batch_queue"])
def test_failed_load_of_a_request_preempted_with_it_in_flight_is_not_hit(
    layout, scheduling
):
    """Caught a tree whose `_preempt_request` keeps no blocks of a request
    preempted for memory while the step that loads its external tokens
    synchronously is in flight (InvalidHit: when that load then fails, a
    block computed on the failed KV stays in the prefix cache; InvalidOutput:
    the token that step sampled is appended). The pool is short of blocks
    while that step is in flight; the prompt is sent again afterwards
    (ValidHit)."""
    harness = Harness(
        Setup(
            layout,
            32,
            72,
            0,
            False,
            64,
            "recompute",
            scheduling == "async",
            scheduling == "batch_queue",
        )
    )
    harness.add_request(**req_args(num_own=40, max_tokens=12))
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.fail_sync_load(
        req_args(prefix=1, num_own=112, num_external=40, max_tokens=4),
        fail=14,
        leaves="memory",
        again=True,
        num_steps=5,
    )
    assert "preempted for memory with a sync load in flight" in harness.noted
    assert "sync load failed after its request was preempted" in harness.noted
    for _ in range(4):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()


@pytest.mark.parametrize("layout", ["gpt_oss_like", "gemma3_like"])
@pytest.mark.parametrize("scheduling", ["async", "batch_queue"])
def test_sharer_preempted_for_a_late_failure_whose_own_load_fails(layout, scheduling):
    """LiveRecords: r0 loads its prefix synchronously in step 1; r1 hits
    r0's blocks and loads its own external tokens in step 2, scheduled while
    step 1 is in flight. Step 1's load fails: r1 is preempted and the output
    of its step 2 is dropped (`discard_output`). Step 2's load (r1's own)
    fails too: the output of r1's last step in flight ends the mark, r1 is
    scheduled again and finishes (a tree that keeps the mark never schedules
    it again)."""
    harness = Harness(
        Setup(
            layout,
            32,
            72,
            0,
            False,
            512,
            "recompute",
            scheduling == "async",
            scheduling == "batch_queue",
        )
    )
    harness.add_request(**req_args(prefix=3, num_own=1, num_external=160))
    harness.step(accept=0, eos_pick=None, fail_sync=0)
    harness.add_request(
        **req_args(prefix=3, num_own=40, num_external=160, max_tokens=4)
    )
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    assert "r1" in connector_state(harness.scheduler, "discard_output")
    harness.step(accept=0, eos_pick=None, fail_sync=None, fail_left=0)
    assert "sync load failed after its request was preempted" in harness.noted
    harness.check_all()
    for _ in range(8):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    harness.drain()
    harness.check_all()
    assert not harness.scheduler.requests


def test_failed_loads_of_two_steps_in_flight_end_the_mark():
    """The shrunk schedule of a fresh-seed run (Mistral-like, HMA off, batch
    queue), replayed through the state machine's rules: a request preempted
    for a load failure reported a step late, whose own load in its step in
    flight fails too, kept `discard_output` with no step in flight
    (LiveRecords) and was never scheduled again."""
    state = SchedulerMachine()
    state.start(
        setup=Setup("mistral_like", 32, 34, 0, False, 64, "recompute", False, True),
        first=[
            req_args(num_own=113, save=True),
            req_args(),
            req_args(num_own=69, num_external=64, load_async=True),
            req_args(prefix=2, num_own=86, num_external=100, load_async=True),
        ],
    )
    state.safety()
    state.abort(pick=1)
    state.safety()
    state.add_request(
        args=req_args(prefix=3, num_own=116, num_external=100, max_tokens=4, save=True)
    )
    state.safety()
    state.steps(accept=0, eos_pick=None, fail_sync=0, fail_left=0, num_steps=1)
    state.safety()
    state.abort_load_in_flight(pick=0)
    state.safety()
    state.fail_sync_load(
        args=req_args(prefix=1, num_own=16, num_external=40),
        fail=0,
        leaves=None,
        again=False,
        num_steps=4,
    )
    state.safety()
    state.abort_load_in_flight(pick=0)
    state.safety()
    state.fail_sync_load(
        args=req_args(num_own=16, num_external=16),
        fail=0,
        leaves=None,
        again=False,
        num_steps=2,
    )
    state.safety()
    state.teardown()


def test_sharer_of_a_sync_load_preempted_with_its_step_in_flight():
    """The shrunk schedule of a fresh-seed run (Mistral-like, HMA off, batch
    queue): r2 loads 100 external tokens synchronously; r3, scheduled after
    it in the same step, hits r2's blocks in the window and computes its next
    blocks on them; the next step preempts r3 for memory while the first is
    in flight; r2's load fails. r3 holds no block, but the blocks it computed
    on the failed KV leave the prefix cache (InvalidHit) and its token of
    that step is not emitted (InvalidOutput)."""
    state = SchedulerMachine()
    state.start(
        setup=Setup("mistral_like", 32, 16, 0, False, 64, "recompute", False, True),
        first=[
            req_args(),
            req_args(),
            req_args(prefix=2, num_external=100),
            req_args(prefix=2, num_own=113),
        ],
    )
    state.safety()
    state.steps(accept=0, eos_pick=None, fail_left=None, fail_sync=0, num_steps=2)
    state.teardown()


def test_block_computed_on_a_failed_load_written_again_by_a_later_step():
    """The shrunk schedule of a fresh-seed run (Mistral-like with a connector
    that declines HMA, batch queue): r4's sync load of block 27 fails while
    its next step, computing block 29 on it, is in flight; r4 is preempted,
    and its prompt sent again (r5) is allocated block 29 and computes it
    whole in a step scheduled after r4's. Steps run in order: block 29 holds
    r5's KV, under r5's block hash, and is a valid prefix cache hit (the
    check of InvalidHit on that block fails without the later write)."""
    state = SchedulerMachine()
    state.start(
        setup=Setup(
            "mistral_like_declined", 32, 32, 0, False, 128, "recompute", False, True
        ),
        first=[
            req_args(num_own=49, num_external=64),
            req_args(num_own=81, num_external=100, load_async=True),
            req_args(prefix=1, num_own=81),
            req_args(prefix=2, num_own=33, num_external=160),
        ],
    )
    state.safety()
    state.fail_sync_load(
        args=req_args(num_own=48, num_external=16),
        fail=0,
        leaves=None,
        again=True,
        num_steps=3,
    )
    state.teardown()
