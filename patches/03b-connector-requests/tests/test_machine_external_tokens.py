"""Stage 03, shrunk schedules of the random `Scheduler` test
(`hmastack_testkit.scheduler_machine`): the blocks external tokens get (WindowBound),
where a request resumes after an async load (ResumeAfterLoad) and the
block tables the connector is given (ConnectorTables).
"""

from __future__ import annotations

import pytest
from hmastack_testkit.scheduler_machine import (
    Harness,
    Setup,
    req_args,
)


@pytest.mark.parametrize("load_async", [False, True])
def test_external_tokens_outside_the_window_get_no_blocks(load_async):
    """Caught a tree that gives the skipped external tokens real blocks
    (WindowBound): a prompt of 81 tokens, 64 of them external, W = 32."""
    harness = Harness(
        Setup("gpt_oss_like", 32, 17, 0, False, 64, "recompute"),
    )
    harness.add_request(**req_args())
    harness.add_request(**req_args())
    harness.add_request(
        **req_args(prefix=2, num_external=64, load_async=load_async, max_tokens=4)
    )
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    full, swa = harness.tables()["r2"]
    # Sync: the prompt (81 tokens); async: the 64 external tokens.
    assert len(full) == (4 if load_async else 6)
    # Skipped for 64 computed tokens: 64 - 32 + 1 = 33 tokens, 2 blocks.
    assert [b.is_null for b in swa] == [True, True] + [False] * (len(full) - 2)
    if load_async:
        harness.finish_load(0)
    for _ in range(6):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    assert not harness.tables()
    assert harness.pool.get_num_free_blocks() == 16


def test_unaligned_async_load_counts_only_loaded_tokens():
    """Not one of the model's properties (found while checking the driver of
    test_s03_connector_allocate): after an async load of 40 external tokens
    (B = 16), 0.13.0's `_update_waiting_for_remote_kv` took the block tables'
    length (3 blocks, 48 tokens) as computed and published block 2, whose
    tokens 40~47 were neither loaded nor computed. Stage 03 resumes the
    request after its 40 loaded tokens."""
    harness = Harness(Setup("gpt_oss_like", 64, 40, 0, False, 256, "recompute"))
    harness.add_request(
        **req_args(num_own=100, num_external=40, load_async=True, max_tokens=8)
    )
    request = harness.scheduler.requests["r0"]
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.finish_load(0)
    harness.step(accept=0, eos_pick=None, fail_sync=None)  # reports the load
    harness.step(accept=0, eos_pick=None, fail_sync=None)  # schedules r0
    harness.check_all()
    assert "r0" in harness.scheduler.requests
    assert request.num_cached_tokens == 40


def test_one_token_prompt_loaded_whole_keeps_its_tables():
    """Caught the stage 05 tree (ConnectorTables): an async load covers a
    one-token prompt, the request resumes with 0 computed tokens (it
    computes the token again) in the blocks it holds, and the scheduler
    looked it up again (a new lookup starts the connector's tables over; its
    blocks were not appended again) and loaded it again, at every attempt."""
    harness = Harness(Setup("gemma3_like", 32, 43, 0, False, 64, "recompute"))
    harness.add_request(**req_args(num_external=40, load_async=True, max_tokens=3))
    harness.step(accept=0, eos_pick=None, fail_sync=None)
    harness.check_all()
    harness.finish_load(0)
    for _ in range(5):
        harness.step(accept=0, eos_pick=None, fail_sync=None)
        harness.check_all()
    assert not harness.connector.pending
    assert not harness.scheduler.requests
