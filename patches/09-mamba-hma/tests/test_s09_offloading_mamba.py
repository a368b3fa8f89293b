"""Stage 09: OffloadingConnector's worker side with the CPU test spec
(``hmastack_testkit.offloading``, the test boundary that copies with torch)
and a Mamba hybrid's KV caches, laid out as the model runner lays them out:
every layer's block i is page i of its KV cache tensor, shared by an
attention layer and a Mamba layer (a list of its conv and SSM state
tensors). A stored block comes back whole, its attention K/V and its Mamba
states bit-exact, in every layer that shares the tensor."""

from __future__ import annotations

import torch
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
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

BLOCK_SIZE = 16
NUM_BLOCKS = 12
PAGE = 2 * 2 * BLOCK_SIZE * 8 * 4  # K and V, 2 heads of 8, float32
CONV, SSM = (3, 24), (2, 8, 8)
FULL, MAMBA = 0, 1


def _kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(NUM_BLOCKS * PAGE, ["attn", "mamba"])],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attn"], FullAttentionSpec(BLOCK_SIZE, 2, 8, torch.float32)
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=BLOCK_SIZE,
                    shapes=(CONV, SSM),
                    dtypes=(torch.float32, torch.float32),
                    page_size_padded=PAGE,
                ),
            ),
        ],
    )


def _worker() -> OffloadingConnector:
    vllm_config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "CPUTestOffloadingSpec",
                "spec_module_path": "hmastack_testkit.offloading",
                "num_cpu_blocks": 8,
            },
        ),
    )
    return OffloadingConnector(vllm_config, KVConnectorRole.WORKER, _kv_cache_config())


def _kv_caches():
    raw = torch.randn(NUM_BLOCKS * PAGE // 4)
    attn = raw.view(2, NUM_BLOCKS, 2, BLOCK_SIZE, 8)
    hidden = attn.shape[2:].numel()
    attn.as_strided_(size=attn.shape, stride=(hidden, 2 * hidden, *attn.stride()[2:]))
    conv = torch.as_strided(raw, (NUM_BLOCKS, *CONV), (PAGE // 4, CONV[1], 1))
    ssm = torch.as_strided(
        raw, (NUM_BLOCKS, *SSM), (PAGE // 4, 64, 8, 1), storage_offset=72
    )
    return raw, {"attn": attn, "mamba": [conv, ssm]}


def _step(worker, meta):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    finished = worker.get_finished(set())
    worker.clear_connector_metadata()
    return finished


def _meta(load=None, store=None) -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(
        reqs_to_load=load or {},
        reqs_to_store=store or {},
        store_seqs={r: 1 for r in store or {}},
        reqs_to_flush={},
    )


def test_attention_and_mamba_state_blocks_round_trip_whole():
    """Store attention block 5 and Mamba state block 7 to CPU slots 0 and 1,
    load them into blocks 9 and 10: K/V and conv/SSM states bit-exact, whole
    pages, no other page written."""
    worker = _worker()
    raw, kv = _kv_caches()
    worker.connector_worker._register_handlers(kv, {})
    before = raw.clone().view(NUM_BLOCKS, -1)
    attn, (conv, ssm) = kv["attn"], kv["mamba"]
    want_attn, want_conv, want_ssm = attn[:, 5].clone(), conv[7].clone(), ssm[7].clone()

    store = (
        GPULoadStoreSpec([5, 7], group_ids=[FULL, MAMBA]),
        CPULoadStoreSpec([0, 1]),
    )
    _step(worker, _meta(store={"r": store}))
    load = (
        CPULoadStoreSpec([0, 1]),
        GPULoadStoreSpec([9, 10], group_ids=[FULL, MAMBA]),
    )
    _, recving = _step(worker, _meta(load={"r2": load}))
    assert recving == {"r2"}

    assert torch.equal(attn[:, 9], want_attn)
    assert torch.equal(conv[10], want_conv)
    assert torch.equal(ssm[10], want_ssm)
    pages = raw.view(NUM_BLOCKS, -1)
    expected = before.clone()
    expected[9], expected[10] = before[5], before[7]
    assert torch.equal(pages, expected)
