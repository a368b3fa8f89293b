"""The only fake of the stage-04 tests: what LMCache needs CUDA for.

LMCache's storage path (``LMCacheEngine`` with the local CPU backend, its
storage manager, memory allocators, token database, lookup client and server)
and its ``VLLMPagedMemGPUConnectorV2`` run for real on CPU. Five points need
CUDA; each is replaced here and nowhere else:

1. ``lmcache.c_ops.multi_layer_kv_transfer``, the copy kernel between vLLM's
   paged KV cache and LMCache's memory objects (``c_ops`` is a CUDA extension,
   not built without CUDA): :class:`TorchCopyKernel` does the same copy with
   torch and records the slots it writes into vLLM's paged memory;
2. ``torch.cuda.Stream`` (created by the GPU connector): a class without a
   device;
3. ``torch.cuda.stream(...)`` contexts: a null context;
4. the GPU connector's check that the paged buffers are CUDA tensors
   (``_assert_cuda_device`` with the stage-04 patch, an inline assertion in
   0.3.11's ``_initialize_pointers``);
5. the adapter's engine set-up, which refuses ``CpuPlatform`` and calls
   ``torch.cuda.set_device``: :func:`build_cpu_engine` builds the same engine
   on CPU first (``create_lmcache_metadata``, ``from_metadata(use_gpu=False)``,
   ``LMCacheEngineBuilder.get_or_create``); the adapter then reuses it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from hmastack_testkit.lmcache_cpu import initialize_pointers_without_device_check


@dataclass
class KernelCopy:
    """One layer's part of one kernel call."""

    ptr: int  # the paged buffer (data_ptr; layers of several groups share one)
    to_lmcache: bool  # True: store (paged -> LMCache), False: load
    slots: list[int]  # the slots read or written (never -1)


@dataclass
class TorchCopyKernel:
    """``lmcache.c_ops`` with ``multi_layer_kv_transfer`` done by torch.

    Same semantics as the CUDA kernel (csrc/mem_kernels.cu): for layer ``j`` of
    ``key_value`` (``[2, num_layers, num_tokens, hidden]``), the paged buffer
    behind ``key_value_ptrs[j]`` (vLLM's ``[2, num_blocks, block_size,
    num_kv_heads, head_size]``, seen as ``[2, page_buffer_size, hidden]``) and
    each token ``t`` with ``slot_mapping[t] >= 0``: copy token ``t`` from the
    slot (``direction`` True) or into it (False). Slots of -1 are skipped.
    """

    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    copies: list[KernelCopy] = field(default_factory=list)
    calls: int = 0

    def register(self, paged_buffers: list[torch.Tensor]) -> None:
        self.buffers = {t.data_ptr(): t for t in paged_buffers}

    def multi_layer_kv_transfer(
        self,
        key_value,
        key_value_ptrs,
        slot_mapping,
        device,
        page_buffer_size,
        direction,
        use_mla,
    ):
        assert not use_mla
        self.calls += 1
        assert key_value.shape[1] == key_value_ptrs.shape[0]
        assert key_value.shape[2] == slot_mapping.shape[0]
        valid = slot_mapping >= 0
        tokens = torch.nonzero(valid).flatten()
        slots = slot_mapping[valid]
        for j, ptr in enumerate(key_value_ptrs.tolist()):
            flat = self.buffers[ptr].view(2, page_buffer_size, -1)
            if direction:
                key_value[:, j, tokens] = flat[:, slots]
            else:
                flat[:, slots] = key_value[:, j, tokens]
            self.copies.append(KernelCopy(ptr, bool(direction), slots.tolist()))

    def written_slots(self) -> dict[int, set[int]]:
        """Paged buffer (data_ptr) -> slots written by loads."""
        out: dict[int, set[int]] = {}
        for c in self.copies:
            if not c.to_lmcache:
                out.setdefault(c.ptr, set()).update(c.slots)
        return out

    def reset(self) -> None:
        self.copies.clear()
        self.calls = 0


class _Stream:
    """``torch.cuda.Stream`` without a device (a class: vLLM annotates
    ``torch.cuda.Stream | None`` elsewhere)."""

    def synchronize(self) -> None:
        pass


def install(monkeypatch) -> TorchCopyKernel:
    """Replace points 1-4 for the duration of a test (``monkeypatch``)."""
    from lmcache.v1 import gpu_connector

    kernel = TorchCopyKernel()
    monkeypatch.setattr(gpu_connector, "lmc_ops", kernel, raising=False)
    if hasattr(gpu_connector, "_assert_cuda_device"):
        monkeypatch.setattr(gpu_connector, "_assert_cuda_device", lambda d: None)
    else:
        monkeypatch.setattr(
            gpu_connector.VLLMPagedMemGPUConnectorV2,
            "_initialize_pointers",
            initialize_pointers_without_device_check,
        )
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return kernel


def build_cpu_engine(vllm_config) -> None:
    """Point 5: LMCache's engine as the adapter's ``_init_lmcache_engine``
    builds it, on CPU, under the adapter's engine name (which it then reuses)."""
    from lmcache.integration.vllm.utils import (
        ENGINE_NAME,
        create_lmcache_metadata,
        lmcache_get_or_create_config,
    )
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    LMCacheEngineBuilder.destroy(ENGINE_NAME)
    metadata, config = create_lmcache_metadata(vllm_config, role="worker")
    assert config is lmcache_get_or_create_config()
    gpu_connector = VLLMPagedMemGPUConnectorV2.from_metadata(
        metadata, use_gpu=False, device=torch.device("cpu")
    )
    LMCacheEngineBuilder.get_or_create(
        ENGINE_NAME,
        config,
        metadata,
        gpu_connector,
        lambda tensor, src: tensor,
        lambda obj, src: obj,
    )


def destroy_engine() -> None:
    """LMCache's storage manager runs a non-daemon thread: destroy the engine
    before the process exits."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(ENGINE_NAME)
