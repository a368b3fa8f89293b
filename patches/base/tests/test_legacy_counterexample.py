"""The model's Legacy counterexamples, reproduced with vLLM's own objects.

TLC finds two violations of the Legacy policy (vLLM 0.13.0), see
``docs/model.md`` ("The Legacy counterexamples") and the reports of
``hmastack spec check legacy legacy-race``:

* ``legacy-race`` (``NoTransferRace``): a prefill chunk of 4 tokens gets full
  ``<<1,2>>`` and sliding-window ``<<3,4>>``; the step runs and the connector
  starts saving blocks 1-4; the next ``allocate_slots`` calls
  ``remove_skipped_blocks``, which returns sliding-window block 3 (now outside
  the window) to the free queue while the save still reads it. Here a second
  request then gets block 3: two owners, one of them a transfer.
* ``legacy`` (``WindowBound``): 5 external tokens loaded asynchronously get a
  sliding-window block each (ceil(5/2) = 3 real blocks) where the window
  needs ceil((W-1)/B) + 1 = 2.

Stage tests for stage k run on every tree >= k, so the expectations depend on
the tree's API, not on a stage number: a tree whose ``allocate_slots`` takes
``num_external_computed_tokens`` (the series' stage 03) must not show the
window-bound violation, and a tree whose ``KVCacheManager`` takes
``hold_freed_blocks`` (stage 03: the hold a KV connector asks for blocks its
store still reads, ``KVConnectorBase_V1.request_blocks_freed``) must not show
the save race when the connector's hook names the blocks being saved. The
model of stage 03's allocation alone (``spec/models/series-save-race.cfg``,
``Policy = "SeriesAllocOnly"``) shows the race; with the hold
(``SeriesAsCoded``, ``series-saves``) it is gone.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from hmastack_testkit.kvtest import make_request
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

# The constants of spec/models/legacy-race.cfg and legacy.cfg.
B = 2  # block size
W = 3  # sliding window
PROMPT_LEN = 6
CHUNK = 4
MAX_EXT = 5
CONTIG = cdiv(W - 1, B)  # trailing blocks a sliding-window hit needs

# The legacy-race trace, as `event` records (act, req, new blocks per group).
# The events of TLC's legacy-race counterexample (act, request, blocks per group);
# tests/unit/test_legacy_race_fixture.py checks it against a fresh TLC run.
LEGACY_RACE = [
    tuple(event)
    for event in json.loads(
        (Path(__file__).parent / "legacy_race_events.json").read_text()
    )
]

HAS_EXTERNAL = (
    "num_external_computed_tokens"
    in inspect.signature(KVCacheManager.allocate_slots).parameters
)
HAS_HOLD = "hold_freed_blocks" in inspect.signature(KVCacheManager).parameters


def make_manager(num_blocks: int, saving: set[int] | None = None) -> KVCacheManager:
    """Group 0 full attention, group 1 sliding window; ids 1..num_blocks-1.
    With ``saving`` the manager holds the freed blocks among them, as the
    scheduler does for a connector whose store reads them."""
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(B, 1, 1, torch.float32)),
        KVCacheGroupSpec(
            ["swa"], SlidingWindowSpec(B, 1, 1, torch.float32, sliding_window=W)
        ),
    ]
    hold = {}
    if saving is not None:
        hold["hold_freed_blocks"] = lambda req_id, block_ids: saving & set(block_ids)
    return KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        ),
        max_model_len=64,
        enable_caching=True,
        hash_block_size=B,
        **hold,
    )


def block_ids(manager: KVCacheManager, req_id: str) -> dict[str, list[int]]:
    tables = manager.coordinator.get_blocks(req_id)
    return {
        g: [b.block_id for b in t]
        for g, t in zip(("full", "swa"), tables, strict=False)
    }


def free_ids(manager: KVCacheManager) -> set[int]:
    queue = manager.block_pool.free_block_queue
    return {b.block_id for b in queue.get_all_free_blocks()}


def run_race(manager: KVCacheManager) -> tuple[set[int], set[int], dict]:
    """Drive the legacy-race trace; returns (saving, freed while saving, r2)."""
    r1 = make_request("r1", list(range(PROMPT_LEN)), B)
    # Step 1 (AllocateSlots r1): prefill chunk of CHUNK tokens.
    assert manager.allocate_slots(r1, CHUNK) is not None
    assert block_ids(manager, "r1") == LEGACY_RACE[0][2]
    # Step 2 (Execute r1): the step ran; the connector saves the full blocks.
    r1.num_computed_tokens = CHUNK
    saving = {b for t in block_ids(manager, "r1").values() for b in t[: CHUNK // B]}
    assert saving == {1, 2, 3, 4}
    # Step 3 (AllocateSlots r1): the rest of the prompt; remove_skipped_blocks
    # runs first (the save has not reported finished_sending).
    new = manager.allocate_slots(r1, PROMPT_LEN - CHUNK)
    assert new is not None
    assert new.get_block_ids() == ([5], [6])
    freed_while_saving = saving & free_ids(manager)
    # Another request is scheduled: it takes what the free queue holds.
    r2 = make_request("r2", [100, 101], B)
    got = manager.allocate_slots(r2, 2)
    assert got is not None
    return saving, freed_while_saving, block_ids(manager, "r2")


@pytest.mark.skipif(HAS_EXTERNAL, reason="legacy allocate_slots only")
def test_legacy_race_reproduces():
    """NoTransferRace on 0.13.0: a block the save reads is freed and re-allocated."""
    # One block more than the model's N = 6, so that r2 can be scheduled.
    manager = make_manager(num_blocks=8)
    saving, freed, r2 = run_race(manager)
    assert freed == {3}, "remove_skipped_blocks freed swa block 3 during the save"
    assert manager.block_pool.blocks[3].ref_cnt == 1  # now r2's
    assert 3 in r2["swa"], f"block 3 re-allocated to r2 while r1's save reads it: {r2}"


@pytest.mark.skipif(not HAS_HOLD, reason="series KVCacheManager with a hold only")
def test_series_race_absent():
    """The connector's hook names the blocks its save reads: block 3 leaves
    the sliding window table but stays held, and r2 gets other blocks."""
    # One block more than the legacy run: block 3 stays held.
    manager = make_manager(num_blocks=9, saving={1, 2, 3, 4})
    saving, freed, r2 = run_race(manager)
    assert not freed, f"blocks {freed} freed while the connector saves them"
    assert not (saving & set(r2["full"] + r2["swa"]))
    assert [b.block_id for b in manager.held_blocks["r1"]] == [3]
    assert manager.block_pool.blocks[3].ref_cnt == 1


def allocate_external_async(manager: KVCacheManager, num_external: int):
    """legacy.cfg's step: a fresh request, `num_external` tokens loaded async."""
    request = make_request("r1", list(range(PROMPT_LEN)), B)
    if HAS_EXTERNAL:
        new = manager.allocate_slots(
            request,
            0,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=True,
        )
    else:
        # 0.13.0: the scheduler passes the external tokens as new tokens.
        new = manager.allocate_slots(request, num_external, delay_cache_blocks=True)
    assert new is not None
    return block_ids(manager, "r1")


def window_bound(num_scheduled: int) -> int:
    return CONTIG + 1 + cdiv(num_scheduled, B)


@pytest.mark.skipif(HAS_EXTERNAL, reason="legacy allocate_slots only")
def test_legacy_window_bound_violated():
    """WindowBound on 0.13.0: ceil(L/B) real sliding-window blocks for L external."""
    manager = make_manager(num_blocks=7)  # the model's N = 6
    tables = allocate_external_async(manager, MAX_EXT)
    real = [b for b in tables["swa"] if b != 0]
    assert len(real) == cdiv(MAX_EXT, B) == 3
    assert len(real) > window_bound(0) == 2
    assert manager.block_pool.get_num_free_blocks() == 0  # all 6 blocks taken


@pytest.mark.skipif(not HAS_EXTERNAL, reason="series allocate_slots only")
def test_series_window_bound_holds():
    manager = make_manager(num_blocks=7)
    tables = allocate_external_async(manager, MAX_EXT)
    real = [b for b in tables["swa"] if b != 0]
    assert len(real) <= window_bound(0)
    # The model's Series table: <<0, x, y>> (skipped block is the null block).
    assert tables["swa"][0] == 0 and len(tables["swa"]) == cdiv(MAX_EXT, B)
    assert len(tables["full"]) == 3
    assert manager.block_pool.get_num_free_blocks() == 6 - 5
