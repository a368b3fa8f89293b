"""Stage 03, shrunk schedules of the random `Scheduler` test
(`hmastack_testkit.scheduler_machine`): a request aborted while the step that loads
its external tokens synchronously is in flight (the in-flight fence):
it leaves no record (LiveRecords), and when that load fails nothing
computed on the failed KV stays a prefix cache hit (InvalidHit,
ValidHit).
"""

from __future__ import annotations

import pytest
from hmastack_testkit.scheduler_machine import (
    Harness,
    Setup,
    connector_state,
    req_args,
)


def test_abort_with_a_sync_load_in_flight_leaves_no_record():
    """Caught a tree whose `_free_blocks` keeps the external tokens in flight
    of a request aborted while the step that loads them synchronously is in
    flight (LiveRecords: a record with `num_external_tokens_in_flight` of a
    request the scheduler no longer has)."""
    harness = Harness(
        Setup("gpt_oss_like", 32, 32, 0, False, 512, "recompute", True),
    )
    harness.add_request(**req_args(num_own=40, num_external=16, max_tokens=4))
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    assert connector_state(harness.scheduler, "num_external_tokens_in_flight") == {
        "r0": 16
    }
    harness.abort(0)
    harness.check_all()
    harness.drain()
    harness.check_all()
    assert not harness.scheduler.requests


@pytest.mark.parametrize("layout", ["llama_like", "gpt_oss_like", "gemma3_like"])
def test_failed_load_of_a_request_aborted_with_it_in_flight_is_not_hit(layout):
    """Caught a tree that keeps no blocks of a request aborted while the step
    that loads its external tokens synchronously is in flight (InvalidHit:
    when that load then fails, a block computed on the failed KV stays in
    the prefix cache), and a tree that evicts no invalid block (ValidHit: a
    request with the same prefix hits the blocks whose load failed)."""
    harness = Harness(Setup(layout, 32, 72, 0, False, 512, "recompute", True))
    harness.add_request(
        **req_args(prefix=3, num_own=40, num_external=160, max_tokens=4)
    )
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    assert harness.loads_in_flight() == ["r0"]
    harness.abort_load_in_flight(0)
    harness.check_all()
    # The model runner returns the step: its load failed.
    harness.step(accept=0, eos_pick=None, fail_sync=None, fail_left=0)
    harness.check_all()
    assert "sync load failed after its request finished" in harness.noted
    harness.add_request(**req_args(prefix=3, num_own=8, max_tokens=2))
    for _ in range(3):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()


@pytest.mark.parametrize("scheduling", ["async", "batch_queue"])
def test_failed_load_of_a_stored_request_aborted_with_it_in_flight_is_not_hit(
    scheduling,
):
    """InvalidHit: r1 loads 15 external tokens synchronously and its
    connector stores it (a delayed free); it is aborted while that step is
    in flight, and the load fails: no block computed on the failed KV may
    stay in the prefix cache."""
    harness = Harness(
        Setup(
            "gemma3_like",
            32,
            16,
            0,
            False,
            64,
            "recompute",
            scheduling == "async",
            scheduling == "batch_queue",
        )
    )
    harness.add_request(**req_args())
    harness.add_request(**req_args(num_own=16, num_external=16, save=True))
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    assert harness.loads_in_flight() == ["r1"]
    harness.abort_load_in_flight(0)
    harness.check_all()
    harness.step(accept=0, eos_pick=None, fail_sync=None, fail_left=0)
    assert "sync load failed after its request finished" in harness.noted
    harness.check_all()
