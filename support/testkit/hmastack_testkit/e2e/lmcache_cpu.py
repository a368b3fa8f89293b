"""LMCache's own storage path inside vLLM's CPU engine: the five CUDA-only points.

LMCache 0.3.11 (with or without the stage-04 patch) runs on CPU unchanged
except at five points that need a CUDA device.
:func:`install` substitutes exactly those, at runtime, in this process; no
LMCache or vLLM source is edited:

1. ``lmcache.c_ops.multi_layer_kv_transfer`` (never imported without CUDA): a
   torch copy between vLLM's paged KV caches and LMCache's memory objects
   (``KV_2LTD``: ``[2, num_layers, num_tokens, hidden]``), slot by slot; slot
   -1 (the null block) is skipped. The CPU attention kernel keeps a K block as
   ``[head_size, block_size]`` internally, so the copy is only right for whole
   blocks: chunk size a multiple of the block size, ``save_unfull_chunk`` off.
2. ``torch.cuda.Stream``: a class whose streams do nothing.
3. ``torch.cuda.stream(...)``: a null context.
4. the CUDA-device assertion of the GPU connector's pointer set-up.
5. the adapter's engine initialisation, which refuses ``CpuPlatform``: the
   same construction with a CPU device (metadata from vLLM's configuration,
   ``VLLMPagedMemGPUConnectorV2`` with ``use_gpu=False``, identity
   broadcasts for one worker).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import torch

from hmastack_testkit.lmcache_cpu import initialize_pointers_without_device_check

os.environ.setdefault("LMCACHE_CHUNK_SIZE", "256")
os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
os.environ.setdefault("LMCACHE_SAVE_UNFULL_CHUNK", "False")

# data_ptr -> vLLM's paged KV cache tensor [2, num_blocks, heads, block, head]
_PAGED: dict[int, torch.Tensor] = {}
COPIES = {"to_lmcache_tokens": 0, "to_vllm_tokens": 0}
# Negative control: on load, leave the j-th layer of each copy call unwritten.
SKIP_LAYER: int | None = None


def multi_layer_kv_transfer(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor,
    slot_mapping: torch.Tensor,
    device,
    page_buffer_size: int,
    direction: bool,
    use_mla: bool,
) -> None:
    """Point 1: copy between ``key_value`` ``[2, num_layers, num_tokens,
    hidden]`` and the paged cache of each layer (``key_value_ptrs[j]``), token
    ``t`` at slot ``slot_mapping[t]`` (block ``slot // B``, offset ``slot % B``),
    tokens with slot -1 skipped. ``direction`` True: paged -> ``key_value``."""
    assert not use_mla, "MLA is not run here"
    slots = slot_mapping.to(torch.long)
    tokens = torch.nonzero(slots >= 0).flatten()
    if tokens.numel() == 0:
        return
    slots = slots[tokens]
    for j, ptr in enumerate(key_value_ptrs.tolist()):
        paged = _PAGED[int(ptr)]
        _, _, heads, block, head = paged.shape
        view = paged.permute(0, 1, 3, 2, 4)  # [2, num_blocks, block, heads, head]
        blk, off = slots // block, slots % block
        if direction:
            data = view[:, blk, off].reshape(2, -1, heads * head)
            key_value[:, j, tokens] = data.to(key_value.dtype)
            COPIES["to_lmcache_tokens"] += int(tokens.numel())
        elif j == SKIP_LAYER:
            continue
        else:
            data = key_value[:, j, tokens].reshape(2, -1, heads, head)
            view[:, blk, off] = data.to(paged.dtype)
            COPIES["to_vllm_tokens"] += int(tokens.numel())


class _CPUStream:
    """Point 2: ``torch.cuda.Stream`` on CPU (a class: vLLM annotates with it)."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, *args, **kwargs):
        return None


def install() -> None:
    """Substitute the five CUDA-only points (see the module docstring)."""
    c_ops = types.ModuleType("lmcache.c_ops")
    c_ops.multi_layer_kv_transfer = multi_layer_kv_transfer
    sys.modules["lmcache.c_ops"] = c_ops
    torch.cuda.Stream = _CPUStream  # point 2
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # point 3

    from lmcache.integration.vllm import vllm_v1_adapter
    from lmcache.v1 import gpu_connector

    gpu_connector.lmc_ops = c_ops  # point 1 (the module imports it under CUDA)
    if hasattr(gpu_connector, "_assert_cuda_device"):  # point 4 (stage 04)
        gpu_connector._assert_cuda_device = lambda device: None
    original_init = gpu_connector.VLLMPagedMemGPUConnectorV2._initialize_pointers

    def initialize_pointers(self, kv_caches):
        for t in kv_caches:
            _PAGED[t.data_ptr()] = t
        if not hasattr(gpu_connector, "_assert_cuda_device"):
            # point 4 on LMCache 0.3.11: the assertion is inline; run the same
            # set-up with a device whose type reads "cuda" for the check only
            return initialize_pointers_without_device_check(self, kv_caches)
        return original_init(self, kv_caches)

    gpu_connector.VLLMPagedMemGPUConnectorV2._initialize_pointers = initialize_pointers
    vllm_v1_adapter._init_lmcache_engine = _init_lmcache_engine_cpu  # point 5


def _init_lmcache_engine_cpu(lmcache_config, vllm_config, role):
    """Point 5: the adapter's engine initialisation with a CPU device."""
    from lmcache.integration.vllm.utils import ENGINE_NAME, create_lmcache_metadata
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    if engine := LMCacheEngineBuilder.get(ENGINE_NAME):
        return engine
    made = create_lmcache_metadata(vllm_config, role=role)
    metadata = made[0] if isinstance(made, tuple) else made
    connector = (
        None
        if role == "scheduler"
        else VLLMPagedMemGPUConnectorV2.from_metadata(
            metadata, use_gpu=False, device=torch.device("cpu")
        )
    )
    return LMCacheEngineBuilder.get_or_create(
        ENGINE_NAME,
        lmcache_config,
        metadata,
        connector,
        lambda tensor, src: tensor,
        lambda obj, src: obj,
    )


def shutdown() -> None:
    """Destroy the engine: otherwise a non-daemon thread keeps the process."""
    try:
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(ENGINE_NAME)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
