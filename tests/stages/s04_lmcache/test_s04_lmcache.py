"""Stage 04, LMCache side: the vLLM v1 adapter with several KV cache groups.

Runs vLLM's LMCacheConnectorV1 in both roles over a real LMCache engine
(local CPU backend) on CPU; only the CUDA boundary is faked (conftest.py).
A model's sliding-window layers must load and store only the slots of the
blocks vLLM really holds for them; a full-attention-only model must see the
same slot mappings and kernel calls as with LMCache 0.3.11.
"""

from __future__ import annotations

import pytest
import torch
from s04_lmcache.harness import BLOCK_SIZE, Pair

CHUNK = 256


def layer_kind(pair: Pair, layer: str) -> str:
    spec = pair.specs[pair.group_of_layer[layer]]
    return type(spec).__name__


def shared_prefix_requests(pair: Pair, prefix_len: int, prompt_len: int):
    """Request A computes and stores a prompt; B shares its first prefix_len
    tokens and is admitted with an external hit."""
    prefix = list(range(1000, 1000 + prefix_len))
    a = pair.add_request(prefix + list(range(5000, 5000 + prompt_len - prefix_len)))
    pair.schedule_new(a)
    pair.step({a.request_id: a.num_tokens})
    b = pair.add_request(prefix + list(range(9000, 9000 + prompt_len - prefix_len)))
    return a, b


@pytest.mark.parametrize(
    ("model", "in_window_tokens"),
    # Hit of 1024 tokens: 1024 - W + 1 tokens are skipped, and the blocks
    # holding only skipped tokens are null: gemma3-like (W=512) keeps blocks
    # 32..63 (512 tokens), gpt-oss-like (W=128) blocks 56..63 (128 tokens).
    [("gemma3-like", 512), ("gpt-oss-like", 128)],
)
def test_external_hit_loads_exactly_the_in_window_slots(
    make_pair, fake_cuda, model, in_window_tokens
):
    pair = make_pair(model, hma=True)
    a, b = shared_prefix_requests(pair, prefix_len=1024, prompt_len=1100)
    fake_cuda.reset()

    num_external = pair.schedule_new(b)
    assert num_external == 1024
    pair.step({b.request_id: b.num_tokens - num_external})

    loaded = fake_cuda.slots_per_layer(to_lmcache=False)
    for layer in pair.layer_names():
        index = pair.layer_names().index(layer)
        expected = pair.slots(b.request_id, layer, 0, num_external)
        assert sorted(loaded[index]) == sorted(expected), layer
        if layer_kind(pair, layer) == "SlidingWindowSpec":
            assert len(expected) == in_window_tokens
        else:
            assert len(expected) == num_external
        # What B got is what A computed, for the same token positions.
        start = num_external - len(expected)
        assert torch.equal(
            pair.kv(b.request_id, layer, start, num_external),
            pair.kv(a.request_id, layer, start, num_external),
        ), layer
    # Nothing is ever copied into the null block.
    assert all(s >= BLOCK_SIZE for slots in loaded.values() for s in slots)
    assert pair.finish(b) == (False, None)


@pytest.mark.parametrize("model", ["gemma3-like", "gpt-oss-like"])
def test_store_after_decode_covers_only_real_blocks(make_pair, fake_cuda, model):
    """A 500-token prompt stores chunk [0, 256); decoding to 512 tokens stores
    chunk [256, 512) from the blocks vLLM still holds at that step."""
    pair = make_pair(model, hma=True)
    req = pair.add_request(list(range(3000, 3500)))
    pair.schedule_new(req)
    pair.step({req.request_id: req.num_tokens})
    fake_cuda.reset()
    while req.num_computed_tokens < 2 * CHUNK - 1:
        pair.step({req.request_id: 1})
    stored_before_boundary = fake_cuda.slots_per_layer(to_lmcache=True)
    assert stored_before_boundary == {}
    pair.step({req.request_id: 1})  # computes token 511: chunk 1 is complete

    stored = fake_cuda.slots_per_layer(to_lmcache=True)
    window = pair.vllm_config.model_config.hf_text_config.sliding_window
    for index, layer in enumerate(pair.layer_names()):
        expected = pair.slots(req.request_id, layer, CHUNK, 2 * CHUNK)
        assert sorted(stored[index]) == sorted(expected), layer
        if layer_kind(pair, layer) == "SlidingWindowSpec":
            # 511 computed before the step: 512 - W tokens skipped.
            first_real = (2 * CHUNK - 1 - window + 1) // BLOCK_SIZE * BLOCK_SIZE
            assert len(expected) == 2 * CHUNK - max(CHUNK, first_real)
        else:
            assert len(expected) == CHUNK

    # A later request with this prefix loads the in-window part of chunk 1,
    # and gets what the decoding request held there.
    fake_cuda.reset()
    other = pair.add_request(list(req.all_token_ids[: 2 * CHUNK]) + [1, 2, 3])
    num_external = pair.schedule_new(other)
    assert num_external == 2 * CHUNK
    pair.step({other.request_id: other.num_tokens - num_external})
    for layer in pair.layer_names():
        real = pair.slots(other.request_id, layer, 0, num_external)
        start = num_external - len(real)
        assert torch.equal(
            pair.kv(other.request_id, layer, start, num_external),
            pair.kv(req.request_id, layer, start, num_external),
        ), layer


def legacy_slot_mapping(block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """LMCache 0.3.11's ReqMeta.from_request_tracker slot mapping."""
    block_ids_t = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(0, BLOCK_SIZE, dtype=torch.long)
    slots = (
        offsets.reshape((1, BLOCK_SIZE))
        + block_ids_t.reshape((len(block_ids), 1)) * BLOCK_SIZE
    )
    return slots.flatten()[:num_tokens]


@pytest.mark.parametrize("hma", [False, True])
def test_full_attention_only_model_is_unchanged(make_pair, fake_cuda, hma):
    """One group: a 1-D slot mapping equal to 0.3.11's, one kernel call with
    all layers per chunk, on store and on load."""
    pair = make_pair("llama-tiny", hma=hma)
    assert len(pair.kv_cache_config.kv_cache_groups) == 1
    a, b = shared_prefix_requests(pair, prefix_len=512, prompt_len=600)
    (meta_a,) = pair.last_meta.requests
    table_a = pair.running[a.request_id].block_tables[0]
    assert meta_a.slot_mapping.dim() == 1
    assert torch.equal(meta_a.slot_mapping, legacy_slot_mapping(table_a, 512))
    assert fake_cuda.calls == 2  # chunks [0, 256) and [256, 512)
    num_layers = len(pair.layer_names())
    assert len(fake_cuda.copies) == 2 * num_layers

    fake_cuda.reset()
    num_external = pair.schedule_new(b)
    pair.step({b.request_id: b.num_tokens - num_external})
    (meta_b,) = pair.last_meta.requests
    table_b = pair.running[b.request_id].block_tables[0]
    assert torch.equal(meta_b.slot_mapping, legacy_slot_mapping(table_b, 512))
    assert fake_cuda.calls == 2
    loaded = fake_cuda.slots_per_layer(to_lmcache=False)
    assert all(
        loaded[i] == legacy_slot_mapping(table_b, 512).tolist()
        for i in range(num_layers)
    )


def test_request_finished_all_groups_hands_blocks_back(make_pair):
    pair = make_pair("gemma3-like", hma=True)
    req = pair.add_request(list(range(300)))
    pair.schedule_new(req)
    pair.step({req.request_id: req.num_tokens})
    assert len(pair.running[req.request_id].block_tables) > 1
    assert pair.finish(req) == (False, None)


def test_unsupported_group_type_is_rejected():
    from lmcache.integration.vllm.utils import kv_cache_groups_from_config
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(16, 1, 8, torch.float32)),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,)),
            ),
        ],
    )
    with pytest.raises(ValueError, match="disable-hybrid-kv-cache-manager"):
        kv_cache_groups_from_config(config)


def test_gpu_connector_needs_one_slot_mapping_row_per_group(fake_cuda):
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.memory_management import (
        MemoryFormat,
        MemoryObjMetadata,
        TensorMemoryObj,
    )

    connector = VLLMPagedMemGPUConnectorV2(hidden_dim_size=8, num_layers=3)
    connector.set_kv_cache_group_ids([1, 0, 1])
    kv_caches = [torch.zeros(2, 4, BLOCK_SIZE, 1, 8) for _ in range(3)]
    fake_cuda.register(kv_caches)
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
    assert fake_cuda.slots_per_layer(to_lmcache=False) == {
        0: [34, 35],
        1: [16, 17, 18, 19],
        2: [34, 35],
    }
    # Each layer got its own data: layer 2, token 3 -> block 2, offset 3.
    assert torch.equal(kv_caches[2][:, 2, 3, 0], data[:, 2, 3])
    assert torch.equal(kv_caches[1][:, 1, 0, 0], data[:, 1, 0])
    assert not kv_caches[0][:, 2, 0].any()  # slot 32 (token 0's) untouched
