"""Stage 07: OffloadingConnector's worker side with the CPU test spec
(``hmastack_testkit.offloading``, the test boundary that copies whole blocks
with torch) and two KV cache groups: each block is stored from, and loaded
into, the KV cache tensors of its own group's layers only; a store reads its
blocks when it finishes (``store_delay_steps``), which is what the hold of
the scheduler side protects."""

from __future__ import annotations

import torch
from hmastack_testkit import offloading
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
    OffloadingConnectorMetadata,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

BLOCK_SIZE = 16
NUM_BLOCKS = 12


def _worker(
    store_delay_steps: int = 0, check_store_reads: bool = False
) -> OffloadingConnector:
    vllm_config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "CPUTestOffloadingSpec",
                "spec_module_path": "hmastack_testkit.offloading",
                "num_cpu_blocks": 8,
                "store_delay_steps": store_delay_steps,
                "check_store_reads": check_store_reads,
            },
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"], FullAttentionSpec(BLOCK_SIZE, 1, 4, torch.float32)
            ),
            KVCacheGroupSpec(
                ["window"],
                SlidingWindowSpec(BLOCK_SIZE, 1, 4, torch.float32, sliding_window=32),
            ),
        ],
    )
    return OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def _kv_caches() -> dict[str, torch.Tensor]:
    # (2, num_blocks, block_size, num_kv_heads, head_size), distinct values
    return {
        name: torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 1, 4)
        for name in ("full", "window")
    }


def _step(worker: OffloadingConnector, meta: OffloadingConnectorMetadata):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    finished = worker.get_finished(set())
    worker.clear_connector_metadata()
    return finished


def _meta(load=None, store=None, flush=None) -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(
        reqs_to_load=load or {},
        reqs_to_store=store or {},
        store_seqs={r: 1 for r in store or {}},
        reqs_to_flush=flush or {},
    )


def test_each_group_is_copied_in_its_own_layers():
    worker = _worker()
    kv = _kv_caches()
    worker.connector_worker._register_handlers(kv, {})
    before = {name: t.clone() for name, t in kv.items()}

    # Store full attention block 5 and sliding window block 7 to CPU 0, 1.
    store = (GPULoadStoreSpec([5, 7], group_ids=[0, 1]), CPULoadStoreSpec([0, 1]))
    _step(worker, _meta(store={"r": store}))
    # Load them back into blocks 9 (full) and 10 (window).
    load = (CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([9, 10], group_ids=[0, 1]))
    _, recving = _step(worker, _meta(load={"r2": load}))
    assert recving == {"r2"}

    assert torch.equal(kv["full"][:, 9], before["full"][:, 5])
    assert torch.equal(kv["window"][:, 10], before["window"][:, 7])
    # A group's block is not written in the other group's layers.
    assert torch.equal(kv["full"][:, 10], before["full"][:, 10])
    assert torch.equal(kv["window"][:, 9], before["window"][:, 9])


def test_a_delayed_store_reads_its_blocks_when_it_finishes():
    """The copy happens when the store finishes: KV written into the block
    meanwhile (a reuse the hold prevents) is what is offloaded. The worker
    reports the request only once the store asked for finished."""
    worker = _worker(store_delay_steps=2)
    kv = _kv_caches()
    worker.connector_worker._register_handlers(kv, {})

    store = (GPULoadStoreSpec([3], group_ids=[1]), CPULoadStoreSpec([0]))
    sending, _ = _step(worker, _meta(store={"r": store}, flush={"r": 1}))
    assert sending == set()
    kv["window"][:, 3] = 7.0  # the block reused by another request
    sending, _ = _step(worker, _meta())
    assert sending == set()
    sending, _ = _step(worker, _meta())
    assert sending == {"r"}

    load = (CPULoadStoreSpec([0]), GPULoadStoreSpec([4], group_ids=[1]))
    _step(worker, _meta(load={"r2": load}))
    assert torch.all(kv["window"][:, 4] == 7.0)


def test_a_store_that_reads_a_reused_block_is_found():
    """With ``check_store_reads`` the spec compares what a delayed store reads
    with the blocks as they were when it started: KV written into one of them
    meanwhile is a finding naming the block and its group; a store whose
    blocks stayed as they were is none."""
    worker = _worker(store_delay_steps=1, check_store_reads=True)
    kv = _kv_caches()
    worker.connector_worker._register_handlers(kv, {})
    found = len(offloading.FINDINGS)

    store = (GPULoadStoreSpec([2, 3], group_ids=[0, 1]), CPULoadStoreSpec([0, 1]))
    _step(worker, _meta(store={"r": store}, flush={"r": 1}))
    _step(worker, _meta())
    assert offloading.FINDINGS[found:] == []

    store = (GPULoadStoreSpec([4, 5], group_ids=[0, 1]), CPULoadStoreSpec([2, 3]))
    _step(worker, _meta(store={"r2": store}, flush={"r2": 1}))
    kv["window"][:, 5] = 7.0  # reused by another request
    _step(worker, _meta())
    (finding,) = offloading.FINDINGS[found:]
    assert "group 1" in finding and "[5]" in finding
