"""Stage 03, shrunk schedules of the random `Scheduler` test
(`hmastack_testkit.scheduler_machine`): blocks a connector reads or writes stay
allocated until it reports the transfer (NoTransferRace), and such a
hold is pending work of the engine (HoldPending).
"""

from __future__ import annotations

import pytest
from hmastack_testkit.scheduler_machine import (
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


def _release_stored_request(harness: Harness) -> list[int]:
    """A stored prompt of 100 tokens prefilled in chunks of 64 on the
    gpt-oss-like layout (window 32): the window slides past blocks that the
    stores of the first chunk still read (held), and the request finishes;
    then the stores are reported. Returns the held blocks released."""
    harness.add_request(**req_args(num_own=100, save=True, max_tokens=2))
    for _ in range(3):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    held = [b for blocks in harness.held().values() for b in blocks]
    assert len(held) > 1
    for _ in range(len(harness.stores_to_report())):
        harness.finish_save(0)
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    return held


def test_held_blocks_enter_the_free_queue_in_the_order_they_left_the_tables():
    """EvictionOrder: the held sliding window blocks enter the free block
    queue when the stores are reported, together and in the order in which
    they left the block table (from the last one back)."""
    harness = Harness(Setup("gpt_oss_like", 32, 72, 0, False, 64, "recompute"))
    held = _release_stored_request(harness)
    harness.check_all()
    released = harness.eviction_order.last_released
    assert sorted(released) == sorted(held)
    places = [harness.eviction_order.places[b] for b in released]
    assert places == sorted(places)


def test_held_blocks_released_out_of_order_are_caught():
    """The check can fail: with the places of the held blocks reversed, the
    release puts them in the queue in the wrong order, and EvictionOrder
    names it."""
    harness = Harness(Setup("gpt_oss_like", 32, 72, 0, False, 64, "recompute"))
    places = harness.manager.held_block_places
    free_held_blocks = harness.manager.free_held_blocks

    def release_in_reverse(*request_ids):
        for block_id in places:
            places[block_id] = -places[block_id]
        free_held_blocks(*request_ids)

    harness.manager.free_held_blocks = release_in_reverse
    _release_stored_request(harness)
    with pytest.raises(AssertionError, match="EvictionOrder violated"):
        harness.check_all()
