"""A test boundary: an OffloadingSpec for the CPU platform.

vLLM's own CPUOffloadingSpec refuses platforms that are not CUDA-alike, and its
transfer handlers use CUDA streams and ``ops.swap_blocks`` (registered for CUDA
only). This spec keeps vLLM's scheduler side (its LRU or ARC manager over a CPU
backend, as CPUOffloadingSpec builds them) and copies whole blocks with torch on
the worker side. It is loaded through ``kv_connector_extra_config``:

    {"spec_name": "CPUTestOffloadingSpec",
     "spec_module_path": "hmastack_testkit.offloading",
     "num_cpu_blocks": N, "store_delay_steps": D, "check_store_reads": True}

A store reads its GPU blocks when it finishes, ``store_delay_steps`` calls of
``get_finished`` after it started (0: at the first), as an asynchronous copy on
a device would: a block the scheduler freed and reused meanwhile is read with
its new KV. Loads finish at once. With several KV cache groups a block is copied
in the KV cache tensors of its group's layers only (``GPULoadStoreSpec.group_ids``);
a model with Mamba layers copies whole pages of each KV cache tensor instead
(block i of every layer is page i, and the layers of every group share a tensor).
With ``check_store_reads`` a store keeps a copy of its blocks as they are when
it starts (after the step that computed them) and compares what it reads when it
finishes: a block whose KV changed meanwhile was reused by another request while
the store read it, and :data:`FINDINGS` says so. Everything else is vLLM's own
code.

It runs on vLLM 0.13.0 too (one KV cache group, no ``group_ids``): the
dimension of a KV cache tensor that indexes its blocks is then found from the
attention backend's KV cache shape.

``NoCopyOffloadingSpec`` keeps the same scheduler side and moves no data
(:class:`NoCopyHandler`): each transfer finishes at the next ``get_finished``
(the benchmark of the scheduler's cost per step, which measures the scheduler
side only), or, with ``"scripted_transfers": True``, when a test says so, for
scheduler-level tests that script what the worker side reports (stage 08's
cross-stage state machine).
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

# What stores read that changed after they started: one line per store
# (the engine runs in the process that reads it).
FINDINGS: list[str] = []
# A number of blocks no other dimension of a KV cache shape has.
_PROBE_BLOCKS = 1_000_003


def _num_blocks_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a KV cache tensor that indexes its blocks: the first
    of size ``num_blocks``."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of {num_blocks} blocks in {tuple(tensor.shape)}")


def _backend_blocks_dim(spec: CPUOffloadingSpec, backend) -> int:
    """The dimension that indexes the blocks in ``backend``'s KV cache shape."""
    model = spec.vllm_config.model_config
    shape = backend.get_kv_cache_shape(
        _PROBE_BLOCKS,
        spec.gpu_block_size,
        model.get_num_kv_heads(spec.vllm_config.parallel_config),
        model.get_head_size(),
    )
    return list(shape).index(_PROBE_BLOCKS)


class _Layer:
    def __init__(
        self, gpu: torch.Tensor, dim: int, num_cpu_blocks: int, group: int | None
    ):
        self.gpu = gpu
        self.dim = dim
        shape = list(gpu.shape)
        shape[dim] = num_cpu_blocks
        self.cpu = torch.zeros(shape, dtype=gpu.dtype)
        self.group = group


def _page_layers(kv_caches: dict, num_blocks: int, num_cpu_blocks: int) -> list[_Layer]:
    """A model with Mamba layers (a layer's entry is a list of its state
    tensors): block i of every layer is page i of its KV cache tensor, which
    layers of every KV cache group share. One layer per tensor, its
    ``(num_blocks, page)`` bytes, copied for a block of any group."""
    layers = []
    seen = set()
    for cache in kv_caches.values():
        first = cache[0] if isinstance(cache, (list, tuple)) else cache
        storage = first.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        page = torch.empty(0, dtype=torch.uint8)
        page.set_(storage, 0, (num_blocks, storage.nbytes() // num_blocks))
        layers.append(_Layer(page, 0, num_cpu_blocks, group=None))
    return layers


class TorchCopyHandler(OffloadingHandler):
    """Copies whole blocks between the KV cache tensors and CPU tensors of the
    same shape; one instance per direction."""

    def __init__(
        self, layers: list[_Layer], store: bool, delay: int, check_reads: bool = False
    ):
        self.layers = layers
        self.store = store
        self.delay = delay if store else 0
        self.check_reads = check_reads and store
        # (job id, calls of get_finished left, spec, the blocks read at the start)
        self._pending: list[
            tuple[int, int, TransferSpec, list[torch.Tensor] | None]
        ] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        started = None
        if self.check_reads:
            started = [
                layer.gpu.index_select(layer.dim, s)
                for layer, s, _ in self._pairs(spec)
            ]
        self._pending.append((job_id, self.delay, spec, started))
        return True

    def get_finished(self) -> list[TransferResult]:
        done: list[TransferResult] = []
        pending = []
        for job_id, left, spec, started in self._pending:
            if left > 0:
                pending.append((job_id, left - 1, spec, started))
                continue
            self._copy(job_id, spec, started)
            done.append((job_id, True))
        self._pending = pending
        return done

    def _pairs(self, spec: TransferSpec):
        """Per layer that the transfer copies: its source and destination
        block ids (a GPU block only in the layers of its KV cache group)."""
        src_spec, dst_spec = spec
        gpu_spec = src_spec if self.store else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        src = torch.from_numpy(src_spec.block_ids)
        dst = torch.from_numpy(dst_spec.block_ids)
        assert len(src) == len(dst), "the test spec copies whole blocks only"
        group_ids = getattr(gpu_spec, "group_ids", None)
        groups = None if group_ids is None else torch.from_numpy(group_ids)
        pairs = []
        for layer in self.layers:
            if groups is None or layer.group is None:
                s, d = src, dst
            else:
                mask = groups == layer.group
                s, d = src[mask], dst[mask]
            if len(s):
                pairs.append((layer, s, d))
        return pairs

    def _copy(
        self, job_id: int, spec: TransferSpec, started: list[torch.Tensor] | None
    ) -> None:
        for i, (layer, s, d) in enumerate(self._pairs(spec)):
            src_t, dst_t = (
                (layer.gpu, layer.cpu) if self.store else (layer.cpu, layer.gpu)
            )
            read = src_t.index_select(layer.dim, s)
            if started is not None:
                self._check(job_id, layer, s, started[i], read)
            dst_t.index_copy_(layer.dim, d, read)

    def _check(self, job_id, layer, blocks, started, read) -> None:
        changed = [
            int(b)
            for j, b in enumerate(blocks)
            if not torch.equal(started.select(layer.dim, j), read.select(layer.dim, j))
        ]
        if changed:
            FINDINGS.append(
                f"store {job_id} read {len(changed)} GPU blocks of KV cache "
                f"group {layer.group} whose KV changed after it started "
                f"(reused while the store read them): {changed[:8]}"
            )


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
            kv_cache_config = getattr(self, "kv_cache_config", None)
            groups = self.layer_group_ids() if kv_cache_config is not None else {}
            mamba = any(isinstance(c, (list, tuple)) for c in kv_caches.values())
            layers = (
                _page_layers(kv_caches, kv_cache_config.num_blocks, self.num_cpu_blocks)
                if mamba
                else [
                    _Layer(
                        tensor,
                        _num_blocks_dim(tensor, kv_cache_config.num_blocks)
                        if kv_cache_config is not None
                        else _backend_blocks_dim(self, attn_backends[name]),
                        self.num_cpu_blocks,
                        groups.get(name, 0),
                    )
                    for name, tensor in kv_caches.items()
                ]
            )
            delay = int(self.extra_config.get("store_delay_steps", 0))
            check = bool(self.extra_config.get("check_store_reads", False))
            self._torch_handlers = (
                TorchCopyHandler(layers, store=True, delay=delay, check_reads=check),
                TorchCopyHandler(layers, store=False, delay=0),
            )
        store, load = self._torch_handlers
        yield GPULoadStoreSpec, CPULoadStoreSpec, store
        yield CPULoadStoreSpec, GPULoadStoreSpec, load


class NoCopyHandler(OffloadingHandler):
    """Transfers that move no data, for both directions. With
    ``finish_at_once`` every transfer finishes at the next ``get_finished``;
    without it, when a test says so (:meth:`finish`): the worker side of a
    scheduler-level test whose completions (a store done, a load done or
    failed) are part of the script.

    ``pending`` maps each job that runs to its transfer spec (GPU -> CPU: a
    store, CPU -> GPU: a load); :meth:`finish` ends one, and the next
    ``get_finished`` returns it (always successful: vLLM's offloading worker
    does not support failed jobs, so a test reports a failed load as the
    load's GPU blocks in ``invalid_block_ids``)."""

    def __init__(self, finish_at_once: bool = True) -> None:
        self.finish_at_once = finish_at_once
        self.pending: dict[int, TransferSpec] = {}
        self._done: list[int] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self.finish_at_once:
            self._done.append(job_id)
        else:
            self.pending[job_id] = spec
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return [(job_id, True) for job_id in done]

    def finish(self, job_id: int) -> TransferSpec:
        """End job ``job_id``: the next ``get_finished`` returns it."""
        spec = self.pending.pop(job_id)
        self._done.append(job_id)
        return spec

    @staticmethod
    def gpu_block_ids(spec: TransferSpec) -> list[int]:
        """The GPU blocks a transfer reads (a store) or writes (a load)."""
        gpu = spec[0] if isinstance(spec[0], GPULoadStoreSpec) else spec[1]
        return [int(b) for b in gpu.block_ids]


class NoCopyOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec's manager (vLLM's LRU or ARC over a CPU backend of
    ``num_cpu_blocks``, extra config ``eviction_policy``); on the worker side
    one :class:`NoCopyHandler` (``handler``) for both directions, which copies
    nothing. Its transfers finish at the next ``get_finished`` (the benchmark
    measures the scheduler's side only), or, with the extra config
    ``"scripted_transfers": True``, when a test calls ``handler.finish``.
    Needs no KV cache tensor: the worker side registers ``torch.empty(0)`` as
    its cross-layer KV cache."""

    def get_manager(self) -> OffloadingManager:
        return super().get_manager()

    def get_handlers(
        self,
        kv_caches: dict[str, torch.Tensor],
        attn_backends,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if not hasattr(self, "handler"):
            scripted = bool(self.extra_config.get("scripted_transfers", False))
            self.handler = NoCopyHandler(finish_at_once=not scripted)
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.handler
