"""Stage 03, shrunk schedules of the random `Scheduler` test
(`hmastack_testkit.scheduler_machine`): failed loads and their recovery, with no
request leaving while a step on the load is in flight: blocks shared
with a failed load (ExclusiveOwnership), a load that fails again and
again (NoReload), blocks computed again (Recached), and a request that
computed on the failed KV of another one's load.
"""

from __future__ import annotations

from hmastack_testkit.scheduler_machine import (
    Harness,
    Setup,
    req_args,
)


def test_failed_sync_load_shares_the_blocks_after_it_uncached():
    """Shared blocks that a load failure took out of the prefix cache, not
    all of them invalid (ExclusiveOwnership): r3 hits r2's two prefix blocks
    while r2's sync load of the first one runs; the load fails. Both compute
    from token 0 again, and evict_blocks takes the invalid block and the one
    computed after it (in both groups) out of the prefix cache: they stay
    shared at the same positions, without a hash, while their holders
    compute them again."""
    harness = Harness(Setup("gpt_oss_like", 32, 16, 0, False, 64, "recompute"))
    harness.add_request(**req_args())
    harness.add_request(**req_args())
    harness.add_request(**req_args(prefix=1, num_external=16))
    harness.add_request(**req_args(prefix=1))
    harness.step(accept=0, eos_pick=None, fail_sync=0)
    harness.check_all()
    (r2_full, r2_swa), (r3_full, r3_swa) = (harness.tables()[r] for r in ("r2", "r3"))
    shared = [b.block_id for b in r2_full[:2] + r2_swa[:2]]
    assert shared == [b.block_id for b in r3_full[:2] + r3_swa[:2]]
    assert set(harness.invalid_slots) == {shared[0]}
    assert all(harness.pool.blocks[b].block_hash is None for b in shared)
    assert harness.evicted == set(shared)
    for _ in range(4):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    assert not harness.tables()
    assert harness.pool.get_num_free_blocks() == 15


def test_sync_load_failing_past_block_0_is_not_loaded_again():
    """Caught a tree that marks only a request that a load failure left no
    valid token (NoReload): with asynchronous scheduling a sync load of 100
    external tokens fails from block 6 on, the request is preempted (its next
    step was in flight), looks up again, and the connector offers the same
    tokens; its load failed again at every attempt."""
    harness = Harness(Setup("llama_like", 64, 64, 0, False, 512, "recompute", True))
    harness.add_request(**req_args(num_own=200, num_external=100, max_tokens=4))
    for _ in range(12):
        # Every sync load fails from block 6 (42 // 7) of its one group on.
        harness.step(accept=0, eos_pick=None, fail_sync=42)
        harness.check_all()
    harness.drain()
    assert not harness.scheduler.requests


def test_blocks_computed_again_after_a_load_failure_are_cached_again():
    """Caught a tree whose truncated request keeps its count of cached
    blocks (Recached): a sync load of 100 external tokens fails from block 6
    on; the request computes blocks 6~12 again, and they must be cached
    again."""
    harness = Harness(Setup("llama_like", 64, 64, 0, False, 512, "recompute"))
    harness.add_request(**req_args(num_own=200, num_external=100, max_tokens=2))
    harness.step(accept=0, eos_pick=None, fail_sync=42)
    harness.check_all()
    for _ in range(4):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    assert not harness.scheduler.requests


def test_sharer_of_blocks_computed_on_a_failed_load_fails_with_it():
    """Caught the stage 03 tree that finds the requests a load failure
    affects by the invalid blocks only (Recached): under the `fail` policy,
    r2 loads 40 tokens synchronously and r3 hits r2's blocks in the same
    step; the load fails in the sliding window group only, where r3 holds
    null blocks. r2 fails; r3 held r2's blocks computed on the failed KV
    (evicted from the prefix cache) and went on with them. It fails too."""
    harness = Harness(Setup("gpt_oss_like", 32, 61, 0, False, 512, "fail"))
    harness.add_request(**req_args())
    harness.add_request(**req_args())
    harness.add_request(**req_args(prefix=3, num_external=40))
    harness.add_request(**req_args(prefix=3, max_tokens=4))
    harness.check_all()
    for fail_sync in (17, None, None):
        harness.step(accept=0, eos_pick=None, fail_sync=fail_sync)
        harness.check_all()
    assert "r3" not in harness.scheduler.requests
