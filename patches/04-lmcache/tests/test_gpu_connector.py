"""The GPU connector's per-group copies (LMCache side of stage 04).

``VLLMPagedMemGPUConnectorV2.set_kv_cache_group_ids`` gives each layer its KV
cache group; each copy then uses the group's row of the slot mapping and
skips its -1 slots. Real connector, copy kernel done with torch
(``hmastack_testkit.lmcache_cuda_boundary``).
"""

from __future__ import annotations

import pytest
import torch
from layouts import BLOCK_SIZE


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


def _memory_obj(data):
    from lmcache.v1.memory_management import (
        MemoryFormat,
        MemoryObjMetadata,
        TensorMemoryObj,
    )

    metadata = MemoryObjMetadata(
        data.shape, data.dtype, 0, data.numel() * 4, 1, fmt=MemoryFormat.KV_2LTD
    )
    return TensorMemoryObj(data, metadata, None)


@pytest.mark.parametrize("group_ids", [None, [0, 0, 0]], ids=["no-groups", "one"])
def test_store_zeroes_null_slots_with_one_group(kernel, group_ids):
    """One KV cache group whose table starts with null blocks (a model whose
    layers all use one sliding window): the 1-D slot mapping has -1 there.
    The store writes zeros for those tokens, not what the memory object (a
    reused LMCache buffer) or the null block held, on every store path."""
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    connector = VLLMPagedMemGPUConnectorV2(hidden_dim_size=8, num_layers=3)
    if group_ids is not None:
        connector.set_kv_cache_group_ids(group_ids)
    kv_caches = [torch.full((2, 4, BLOCK_SIZE, 1, 8), 5.0) for _ in range(3)]
    for t in kv_caches:
        t[:, 0] = -1.0  # the null block
    kernel.register(kv_caches)
    stored = torch.full((2, 3, 4, 8), 7.0)  # stale content of a reused buffer
    slot_mapping = torch.tensor([-1, -1, 34, 35])
    connector.from_gpu(
        _memory_obj(stored), 0, 4, kvcaches=kv_caches, slot_mapping=slot_mapping
    )
    assert not stored[:, :, :2].any()
    assert bool((stored[:, :, 2:] == 5.0).all())


def test_transfers_reuse_their_buffers(kernel, monkeypatch):
    """The device buffers a grouped copy needs are allocated by the first
    transfer (sized by the chunk) and reused: later stores and loads, of a
    full or a shorter chunk, allocate no tensor."""
    from lmcache.v1 import gpu_connector as gc

    connector = gc.VLLMPagedMemGPUConnectorV2(
        hidden_dim_size=8, num_layers=3, chunk_size=4
    )
    connector.set_kv_cache_group_ids([1, 0, 1])
    kv_caches = [torch.zeros(2, 4, BLOCK_SIZE, 1, 8) for _ in range(3)]
    kernel.register(kv_caches)
    slot_mapping = torch.tensor([[16, 17, 18, 19], [-1, -1, 34, 35]])

    def transfer(num_tokens: int) -> None:
        data = torch.ones(2, 3, num_tokens, 8)
        kwargs = dict(kvcaches=kv_caches, slot_mapping=slot_mapping)
        connector.to_gpu(_memory_obj(data), 0, num_tokens, **kwargs)
        connector.from_gpu(_memory_obj(data), 0, num_tokens, **kwargs)

    transfer(4)
    allocations = []
    for name in ("empty", "zeros", "full", "empty_like", "zeros_like"):
        original = getattr(torch, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            allocations.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    transfer(4)
    transfer(2)
    assert allocations == []
