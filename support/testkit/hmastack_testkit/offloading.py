"""A test boundary: an OffloadingSpec for the CPU platform.

vLLM's own CPUOffloadingSpec refuses platforms that are not CUDA-alike, and its
transfer handlers use CUDA streams and ``ops.swap_blocks`` (registered for CUDA
only). This spec keeps vLLM's scheduler side (its LRU or ARC manager over a CPU
backend, as CPUOffloadingSpec builds them) and copies whole blocks with torch on
the worker side. It is loaded through ``kv_connector_extra_config``:

    {"spec_name": "CPUTestOffloadingSpec",
     "spec_module_path": "hmastack_testkit.offloading",
     "num_cpu_blocks": N, "store_delay_steps": D}

A store reads its GPU blocks when it finishes, ``store_delay_steps`` calls of
``get_finished`` after it started (0: at the first), as an asynchronous copy on
a device would: a block the scheduler freed and reused meanwhile is read with
its new KV. Loads finish at once. With several KV cache groups a block is copied
in the KV cache tensors of its group's layers only (``GPULoadStoreSpec.group_ids``).
Everything else is vLLM's own code.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager
from vllm.v1.kv_offload.cpu import CPUOffloadingSpec
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)


def _num_blocks_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a KV cache tensor that indexes its blocks: the first
    of size ``num_blocks``."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of {num_blocks} blocks in {tuple(tensor.shape)}")


class _Layer:
    def __init__(self, gpu: torch.Tensor, dim: int, num_cpu_blocks: int, group: int):
        self.gpu = gpu
        self.dim = dim
        shape = list(gpu.shape)
        shape[dim] = num_cpu_blocks
        self.cpu = torch.zeros(shape, dtype=gpu.dtype)
        self.group = group


class TorchCopyHandler(OffloadingHandler):
    """Copies whole blocks between the KV cache tensors and CPU tensors of the
    same shape; one instance per direction."""

    def __init__(self, layers: list[_Layer], store: bool, delay: int):
        self.layers = layers
        self.store = store
        self.delay = delay if store else 0
        # (job id, calls of get_finished left, spec)
        self._pending: list[tuple[int, int, TransferSpec]] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self._pending.append((job_id, self.delay, spec))
        return True

    def get_finished(self) -> list[TransferResult]:
        done: list[TransferResult] = []
        pending = []
        for job_id, left, spec in self._pending:
            if left > 0:
                pending.append((job_id, left - 1, spec))
                continue
            self._copy(spec)
            done.append((job_id, True))
        self._pending = pending
        return done

    def _copy(self, spec: TransferSpec) -> None:
        src_spec, dst_spec = spec
        gpu_spec = src_spec if self.store else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        src = torch.from_numpy(src_spec.block_ids)
        dst = torch.from_numpy(dst_spec.block_ids)
        assert len(src) == len(dst), "the test spec copies whole blocks only"
        groups = (
            None if gpu_spec.group_ids is None else torch.from_numpy(gpu_spec.group_ids)
        )
        for layer in self.layers:
            if groups is None:
                s, d = src, dst
            else:
                mask = groups == layer.group
                s, d = src[mask], dst[mask]
            if len(s) == 0:
                continue
            src_t, dst_t = (
                (layer.gpu, layer.cpu) if self.store else (layer.cpu, layer.gpu)
            )
            dst_t.index_copy_(layer.dim, d, src_t.index_select(layer.dim, s))


class CPUTestOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec's manager; handlers that copy with torch on CPU."""

    def get_manager(self) -> OffloadingManager:
        return super().get_manager()

    def get_handlers(
        self,
        kv_caches: dict[str, torch.Tensor],
        attn_backends,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if not hasattr(self, "_torch_handlers"):
            assert self.offloaded_block_size == self.gpu_block_size, (
                "the test spec copies whole GPU blocks"
            )
            assert self.kv_cache_config is not None
            num_blocks = self.kv_cache_config.num_blocks
            groups = self.layer_group_ids()
            layers = [
                _Layer(
                    tensor,
                    _num_blocks_dim(tensor, num_blocks),
                    self.num_cpu_blocks,
                    groups.get(name, 0),
                )
                for name, tensor in kv_caches.items()
            ]
            delay = int(self.extra_config.get("store_delay_steps", 0))
            self._torch_handlers = (
                TorchCopyHandler(layers, store=True, delay=delay),
                TorchCopyHandler(layers, store=False, delay=0),
            )
        store, load = self._torch_handlers
        yield GPULoadStoreSpec, CPULoadStoreSpec, store
        yield CPULoadStoreSpec, GPULoadStoreSpec, load
