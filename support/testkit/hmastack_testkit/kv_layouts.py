"""KV cache specs, KV cache groups and CPU configurations built the way vLLM's
own tests build them: one copy for the stage tests (``hmastack_testkit.kvtest``,
``patches/04-lmcache/tests/layouts.py``) and the benchmark scenarios
(``bench/scenarios/_common.py``).

Runs inside a vLLM tree's process (the base, every stage, the v0.14.0 peer):
only vLLM's public v1 KV cache classes and its config classes are used.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# The attention kinds :func:`make_spec` builds, by vLLM's spec class.
KINDS = ("full", "sliding_window", "chunked_local", "mamba", "cross_attention")


def make_spec(
    kind: str,
    block_size: int,
    window: int | None,
    num_kv_heads: int = 1,
    head_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> KVCacheSpec:
    """One layer's KV cache spec of attention type ``kind`` (one of
    :data:`KINDS`).

    ``window``: the sliding window or the attention chunk size, in tokens
    (ignored by the other kinds). ``block_size`` in tokens; ``num_kv_heads``
    and ``head_size`` give the attention kinds' page size (a Mamba spec has one
    state of one float32 here). Raises ``ValueError`` for another ``kind``.
    """
    shape = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )
    if kind == "full":
        return FullAttentionSpec(**shape)
    if kind == "sliding_window":
        return SlidingWindowSpec(**shape, sliding_window=window)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=window)
    if kind == "mamba":
        return MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(torch.float32,))
    if kind == "cross_attention":
        return CrossAttentionSpec(**shape)
    raise ValueError(f"unknown attention kind {kind!r}; one of {', '.join(KINDS)}")


def make_kv_cache_groups(
    kinds: list[str], block_size: int, window: int | None
) -> list[KVCacheGroupSpec]:
    """One single-layer KV cache group per entry of ``kinds`` (see
    :func:`make_spec`; ``window`` in tokens), layers named ``layer<i>``."""
    return [
        KVCacheGroupSpec([f"layer{i}"], make_spec(kind, block_size, window))
        for i, kind in enumerate(kinds)
    ]


def make_kv_cache_config(
    kinds: list[str], block_size: int, window: int | None, num_blocks: int
) -> KVCacheConfig:
    """The scheduler's ``KVCacheConfig`` of :func:`make_kv_cache_groups`:
    ``num_blocks`` blocks (the null block included), no KV cache tensors."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=make_kv_cache_groups(kinds, block_size, window),
    )


def make_request(
    request_id: str,
    token_ids: list[int],
    block_size: int,
    max_tokens: int = 64,
    eos_token_id: int | None = None,
):
    """A request whose block hashes are computed per ``block_size`` tokens with
    sha256 (the caller runs vLLM's ``init_none_hash(sha256)`` once per process
    first: a second call draws another seed without ``PYTHONHASHSEED``); it
    stops at ``eos_token_id`` (None: only at ``max_tokens``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        eos_token_id=eos_token_id,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def make_cpu_vllm_config(
    block_size: int,
    num_blocks: int,
    kv_transfer_config,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None = None,
    *,
    model: str = "facebook/opt-125m",
    dtype: str = "float16",
    seed: int = 0,
    num_gpu_blocks_override: int | None = None,
    kv_events_config=None,
):
    """A ``VllmConfig`` for a CPU scheduler with prefix caching, chunked
    prefill and the KV connector of ``kv_transfer_config`` (or none); the
    model is a hub config only (no weights, no tokenizer; ``build/hf-home``).

    ``num_blocks`` (the null block included) is set as the cache config's
    ``num_gpu_blocks``; ``num_gpu_blocks_override`` is passed on for code that
    sizes the KV cache itself (``get_kv_cache_configs``). ``max_model_len``
    None: the model config's. ``kv_events_config``: vLLM's ``KVEventsConfig``
    (KV cache events), or None.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model,
        dtype=dtype,
        seed=seed,
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
            num_gpu_blocks_override=num_gpu_blocks_override,
        ),
        kv_transfer_config=kv_transfer_config,
        kv_events_config=kv_events_config,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def make_scheduler(
    vllm_config,
    kv_cache_config: KVCacheConfig,
    *,
    scheduler_cls=None,
    log_stats: bool = False,
):
    """The scheduler of ``vllm_config`` over ``kv_cache_config``, as vLLM's
    engine core builds it: vLLM's ``Scheduler`` (or ``scheduler_cls``, e.g.
    ``AsyncScheduler``) with a structured output manager and the cache
    config's block size. ``log_stats`` is off unless asked for (prefix cache
    and scheduler stats cost a little on every step)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return (scheduler_cls or Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=log_stats,
    )
