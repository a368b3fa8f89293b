"""The GPU connector's per-group copies (LMCache side of stage 04).

``VLLMPagedMemGPUConnectorV2.set_kv_cache_group_ids`` gives each layer its KV
cache group; each copy then uses the group's row of the slot mapping and
skips its -1 slots. Real connector, copy kernel done with torch
(``cuda_boundary``).
"""

from __future__ import annotations

import pytest
import torch
from s04_lmcache.layouts import BLOCK_SIZE


def test_gpu_connector_copies_each_layer_with_its_group_row(kernel):
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.memory_management import (
        MemoryFormat,
        MemoryObjMetadata,
        TensorMemoryObj,
    )

    connector = VLLMPagedMemGPUConnectorV2(hidden_dim_size=8, num_layers=3)
    connector.set_kv_cache_group_ids([1, 0, 1])
    kv_caches = [torch.zeros(2, 4, BLOCK_SIZE, 1, 8) for _ in range(3)]
    kernel.register(kv_caches)
    data = torch.arange(2 * 3 * 4 * 8, dtype=torch.float32).view(2, 3, 4, 8)
    metadata = MemoryObjMetadata(
        data.shape, data.dtype, 0, data.numel() * 4, 1, fmt=MemoryFormat.KV_2LTD
    )
    memory_obj = TensorMemoryObj(data, metadata, None)
    with pytest.raises(ValueError, match="one row per KV cache group"):
        connector.to_gpu(
            memory_obj, 0, 4, kvcaches=kv_caches, slot_mapping=torch.arange(4)
        )
    # Group 1 (layers 0 and 2) holds the null block for tokens 0 and 1.
    slot_mapping = torch.tensor([[16, 17, 18, 19], [-1, -1, 34, 35]])
    connector.to_gpu(memory_obj, 0, 4, kvcaches=kv_caches, slot_mapping=slot_mapping)
    written = kernel.written_slots()
    assert written == {
        kv_caches[0].data_ptr(): {34, 35},
        kv_caches[1].data_ptr(): {16, 17, 18, 19},
        kv_caches[2].data_ptr(): {34, 35},
    }
    # Each layer got its own data: layer 2, token 3 -> block 2, offset 3.
    assert torch.equal(kv_caches[2][:, 2, 3, 0], data[:, 2, 3])
    assert torch.equal(kv_caches[1][:, 1, 0, 0], data[:, 1, 0])
    assert not kv_caches[0][:, 2, 0].any()  # slot 32 (token 0's) untouched

    # A store reads each layer with its group's row; tokens in the null block
    # of a layer's group are stored as zeros, not as what block 0 holds.
    for t in kv_caches:
        t[:, 0] = -1.0
    stored = torch.full_like(data, 7.0)
    memory_obj = TensorMemoryObj(stored, metadata, None)
    connector.from_gpu(memory_obj, 0, 4, kvcaches=kv_caches, slot_mapping=slot_mapping)
    assert torch.equal(stored[:, 1], data[:, 1])
    assert not stored[:, 0, :2].any() and not stored[:, 2, :2].any()
    assert torch.equal(stored[:, 2, 2:], data[:, 2, 2:])
