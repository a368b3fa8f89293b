"""Shared helpers of our stage tests: KV cache specs and requests built the way
vLLM's own tests build them, with one hashing setup for every stage.

Imported by ``tests/stages/sNN_*/test_*.py`` (``tests/stages`` is on PYTHONPATH
inside the stage matrix).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

# The model policies (spec/HybridKVAlloc.tla) that describe this tree's stage
# 03: "SeriesAllocOnly" (stage 03's allocation alone, patches 12-13 of the series) and
# "SeriesAsCoded" (the fifteen commits). A replay fixture names the one it was
# generated for (fixtures/replay-small.cfg).
REPLAY_POLICIES = ("SeriesAllocOnly", "SeriesAsCoded")

init_none_hash(sha256)


def hypothesis_settings(max_examples: int) -> settings:
    """Deterministic examples: the stage matrix must give the same verdict on every
    run (a property falsified by a random seed is recorded as a regular test)."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def make_spec(kind: str, block_size: int, window: int):
    """A one-layer KV cache spec of attention type ``kind``.

    ``window`` is the sliding window or the attention chunk size, in tokens.
    """
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 1, torch.float32)
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size, 1, 1, torch.float32, sliding_window=window)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(
            block_size, 1, 1, torch.float32, attention_chunk_size=window
        )
    if kind == "mamba":
        return MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(torch.float32,))
    assert kind == "cross_attention", kind
    return CrossAttentionSpec(block_size, 1, 1, torch.float32)


def make_request(request_id: str, token_ids: list[int], block_size: int) -> Request:
    """A request whose block hashes are computed per ``block_size`` tokens."""
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        eos_token_id=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def steer_free_queue(block_pool, m2r: dict, r2m: dict, model_blocks: list) -> None:
    """Put the blocks a model step takes at the head of vLLM's free queue.

    The model may take any free block (evicting a cached one); vLLM takes the
    head of its free block queue (LRU order). That order is the eviction policy,
    not a property under test, so a replay reorders the queue before the step:
    ``model_blocks`` (model block ids in vLLM's allocation order: group by
    group, table order) through the bijection ``m2r``/``r2m``; a block the model
    never used stands for one vLLM never used. A block that is not free yet
    (freed during the step) cannot be placed: the replay's eviction check then
    stops the trace if vLLM chose another block.
    """
    queue = block_pool.free_block_queue
    free = queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    unused = [b for b in free if b.block_id not in r2m]
    head = []
    for m in model_blocks:
        x = m2r.get(m)
        if x is None and unused:
            head.append(unused.pop(0))
        elif x is not None and x in free_ids:
            head.append(block_pool.blocks[x])
    head_ids = {b.block_id for b in head}
    for b in free:
        queue.remove(b)
    queue.append_n(head + [b for b in free if b.block_id not in head_ids])


def compare_pool(block_pool, m2r: dict, state: dict, num_blocks: int) -> list[str]:
    """Differences between a model state's pool (``ref``: ref count of model
    blocks 1..num_blocks, ``freeQ``: its free queue) and vLLM's block pool,
    through the bijection ``m2r`` (model block id -> vLLM block id; an unmapped
    block has ref count 0)."""
    problems = []
    for m in range(1, num_blocks + 1):
        x = m2r.get(m)
        real_ref = block_pool.blocks[x].ref_cnt if x is not None else 0
        if real_ref != state["ref"][m - 1]:
            problems.append(
                f"ref_cnt of model block {m} (vLLM {x}): model "
                f"{state['ref'][m - 1]}, vLLM {real_ref}"
            )
    if block_pool.get_num_free_blocks() != len(state["freeQ"]):
        problems.append(
            f"free blocks: model {len(state['freeQ'])}, "
            f"vLLM {block_pool.get_num_free_blocks()}"
        )
    return problems


def steer_hits(block_pool, real_blocks) -> None:
    """Make ``get_one_block`` return the given blocks for their keys.

    A prefix-cache key may name several blocks (``BlockHashToBlockMap`` keeps
    every block published under it); the model's hit may take any of them,
    vLLM takes the first of the key's dict. As with the free queue (see
    ``steer_free_queue``) that choice is not a property under test, so a
    replay moves the model's choice to the front before the lookup.
    """
    cache = block_pool.cached_block_hash_to_block._cache
    for x in real_blocks:
        block = block_pool.blocks[x]
        entry = cache.get(block.block_hash) if block.block_hash is not None else None
        if isinstance(entry, dict) and next(iter(entry)) != x and x in entry:
            cache[block.block_hash] = {x: block} | {
                k: v for k, v in entry.items() if k != x
            }


class AdmissionSpy:
    """Records what ``get_num_blocks_to_allocate`` of a KV cache coordinator
    returns (vLLM's own admission count), so a replay can compare it with the
    model's prediction, and refusals with refusals."""

    def __init__(self, coordinator):
        self.counts: list[int] = []
        self._count = coordinator.get_num_blocks_to_allocate
        coordinator.get_num_blocks_to_allocate = self._record

    def _record(self, *args, **kwargs) -> int:
        count = self._count(*args, **kwargs)
        self.counts.append(count)
        return count


class SkippedBlocksSpy:
    """Records the ``remove_skipped_blocks`` calls vLLM makes on a KV cache
    coordinator, so that a replay that frees the skipped blocks itself (to steer
    the eviction, see ``steer_free_queue``) can still check that vLLM's own
    ``allocate_slots`` asks for the same free."""

    def __init__(self, coordinator):
        self.calls: list[tuple[str, int]] = []
        self._remove = coordinator.remove_skipped_blocks
        coordinator.remove_skipped_blocks = self._record

    def _record(self, request_id: str, num_computed_tokens: int) -> None:
        self.calls.append((request_id, num_computed_tokens))
        self._remove(request_id, num_computed_tokens)

    def free_now(self, request_id: str, num_computed_tokens: int) -> None:
        """The replay's own call (not recorded)."""
        self._remove(request_id, num_computed_tokens)


def bind_new_blocks(
    m2r: dict, r2m: dict, model_tables: dict, real_tables: dict, new_blocks: dict
) -> None:
    """Extend the bijection model block <-> vLLM block (``m2r``/``r2m``) with the
    blocks one step allocated, position by position in each group's table.

    ``model_tables`` and ``real_tables``: group -> block ids of one request after
    the step; ``new_blocks``: group -> the model's block ids allocated in the
    step. A block bound before (a freed block reused) is bound anew.
    """
    for group, model_ids in model_tables.items():
        fresh = set(new_blocks[group])
        for m, x in zip(model_ids, real_tables[group], strict=False):
            if m not in fresh:
                continue
            old_x = m2r.pop(m, None)
            if old_x is not None:
                r2m.pop(old_x, None)
            old_m = r2m.pop(x, None)
            if old_m is not None:
                m2r.pop(old_m, None)
            m2r[m], r2m[x] = x, m


def compare_table(request_id: str, real: dict, model: dict, r2m: dict) -> list[str]:
    """Differences between one request's block tables in vLLM (``real``: group ->
    vLLM block ids) and in a model state (``model``: group -> model block ids,
    0 the null block), through the bijection ``r2m`` (vLLM -> model id)."""
    problems = []
    for group, real_ids in real.items():
        mapped = [0 if x == 0 else r2m.get(x, f"?{x}") for x in real_ids]
        if mapped != model[group]:
            problems.append(
                f"table {request_id}.{group}: model {model[group]}, "
                f"vLLM {real_ids} = {mapped} as model ids"
            )
    return problems


def make_kv_cache_groups(
    kinds: list[str], block_size: int, window: int
) -> list[KVCacheGroupSpec]:
    """One single-layer KV cache group per entry of ``kinds`` ("full" or
    "sliding_window"; ``window`` in tokens), layers named ``layer<i>``."""
    return [
        KVCacheGroupSpec([f"layer{i}"], make_spec(kind, block_size, window))
        for i, kind in enumerate(kinds)
    ]


def make_cpu_vllm_config(
    block_size: int,
    num_blocks: int,
    kv_transfer_config: KVTransferConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None = None,
) -> VllmConfig:
    """A VllmConfig for a CPU Scheduler with prefix caching, chunked prefill and
    a KV connector; the model is a hub config only (no weights, no
    tokenizer). ``num_blocks`` includes the null block."""
    model_config = ModelConfig(
        model="facebook/opt-125m",
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=0.9,
            swap_space=0,
            enable_prefix_caching=True,
        ),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config
