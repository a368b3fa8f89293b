"""LMCache on CPU: the one piece the stage-04 tests
(:mod:`hmastack_testkit.lmcache_cuda_boundary`) and the engine side of
``hmastack e2e`` (:mod:`hmastack_testkit.e2e.lmcache_cpu`) replace in the
same way; the docstring of ``lmcache_cuda_boundary`` lists the five points of
LMCache that need CUDA.

The copy kernels stay apart: the stage tests view vLLM's paged KV cache as the
GPU model runner lays it out (``[2, num_blocks, block_size, num_kv_heads,
head_size]``), the engine as vLLM's CPU attention backend does (``[2,
num_blocks, num_kv_heads, block_size, head_size]``).
"""

from __future__ import annotations


def initialize_pointers_without_device_check(self, kv_caches):
    """LMCache 0.3.11's ``VLLMPagedMemGPUConnectorV2._initialize_pointers``
    minus its CUDA-device assertion (0.3.11 has it inline; the stage-04 patch
    moves it into ``_assert_cuda_device``, which callers replace instead).

    ``kv_caches``: vLLM's paged KV cache of every layer (one tensor each, the
    same ``[2, num_blocks, ...]`` shape); sets the connector's ``device``, its
    pointer table (one ``data_ptr`` a layer) and ``page_buffer_size`` (slots of
    one layer: ``num_blocks * dim 2``, the block size in the GPU layout; in
    the CPU layout dim 2 is the KV heads, a figure the engine's copy kernel
    does not read). Returns the pointer table of the device.
    """
    self.device = kv_caches[0].device
    idx = self.device.index
    if idx in self.kv_cache_pointers_on_gpu:
        return self.kv_cache_pointers_on_gpu[idx]
    self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
    self.kv_cache_pointers_on_gpu[idx] = self.kv_cache_pointers.clone()
    self.page_buffer_size = kv_caches[0].shape[1] * kv_caches[0].shape[2]
    return self.kv_cache_pointers_on_gpu[idx]
