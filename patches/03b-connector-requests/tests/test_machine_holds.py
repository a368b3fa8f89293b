"""Stage 03, shrunk schedules of the random `Scheduler` test
(`scheduler_machine.py`): blocks a connector reads or writes stay
allocated until it reports the transfer (NoTransferRace), and such a
hold is pending work of the engine (HoldPending).
"""

from __future__ import annotations

import pytest
from scheduler_machine import (
    Harness,
    Setup,
    req_args,
)


def test_abort_during_async_load_keeps_blocks_until_finished_recving():
    """Caught a tree whose `_free_request` frees the blocks of a request
    aborted during its async load (NoTransferRace: the load's block went
    back to the free queue)."""
    harness = Harness(
        Setup("gemma3_like", 32, 16, 0, False, 64, "recompute"),
    )
    harness.add_request(**req_args())
    harness.add_request(**req_args(num_external=16, load_async=True))
    harness.check_all()
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    assert set(harness.connector.pending) == {"r1"}
    (loading,) = harness.connector.pending.values()
    harness.abort(0)  # r1: r0 finished (max_tokens=1)
    harness.check_all()
    block_pool = harness.pool
    for block_id in loading.all_block_ids():
        assert block_pool.blocks[block_id].ref_cnt == 1
    harness.finish_load(0)
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    assert not harness.tables()
    assert block_pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("hold", ["delayed_free", "abort_during_load"])
def test_holds_with_no_request_left_are_pending_work(hold):
    """HoldPending: a finished request whose blocks wait for the connector's
    report (a delayed free; an abort during an async load) keeps
    `has_requests()` True after its finished id went out, until the report;
    then nothing is pending."""
    harness = Harness(Setup("gemma3_like", 32, 16, 0, False, 64, "recompute"))
    if hold == "delayed_free":
        harness.add_request(**req_args(num_own=10, save=True))
    else:
        harness.add_request(**req_args(num_own=40, num_external=16, load_async=True))
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    if hold == "abort_during_load":
        harness.abort(0)
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    scheduler = harness.scheduler
    assert not scheduler.running and not scheduler.waiting
    assert not scheduler.finished_req_ids
    assert scheduler.has_requests()
    if hold == "delayed_free":
        harness.finish_save(0)
    else:
        harness.finish_load(0)
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    assert not harness.tables()
    assert not scheduler.has_requests()
