"""Stage 04: LMCache's vLLM v1 adapter with vLLM's KV cache groups, on CPU.

What is real: vLLM's `LMCacheConnectorV1` (scheduler and worker role), LMCache's
`LMCacheConnectorV1Impl` (request trackers, slot mappings, load and save specs),
its `LMCacheEngine` with the local CPU backend, its lookup client and server,
and `VLLMPagedMemGPUConnectorV2` (which layers, which slot mapping row).

What is faked, and only because it needs CUDA:
- `lmcache.c_ops.multi_layer_kv_transfer`, the copy kernel: `FakeCOps` does
  the same copy with torch on CPU tensors and records, per call and per
  layer, which slots it touched;
- `torch.cuda.Stream` / `torch.cuda.stream`, and the connector's check that
  the paged buffers are CUDA tensors;
- the CUDA device set-up of the LMCache engine: the tests build the engine
  (with a CPU connector) before the adapter, which then reuses it.

The scheduler output is built as vLLM's scheduler builds it with stage 03: a
sliding-window group holds the null block (0) for the blocks before its
window. The same helpers run against LMCache 0.3.11 (`before_after.py`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import pytest
import torch

os.environ.setdefault("LMCACHE_CHUNK_SIZE", "256")
os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
os.environ.setdefault("LMCACHE_SAVE_DECODE_CACHE", "True")
os.environ.setdefault("LMCACHE_SAVE_UNFULL_CHUNK", "False")


@dataclass
class Copy:
    """One layer's part of one kernel call."""

    layer: int  # index of the layer in the adapter's kv_caches
    to_lmcache: bool  # True: store (paged -> LMCache), False: load
    slots: list[int]  # the slots the kernel read or wrote (never -1)


@dataclass
class FakeCOps:
    """`lmcache.c_ops` with the copy kernel done by torch on CPU tensors.

    `multi_layer_kv_transfer` has the kernel's semantics: for layer j of
    `key_value` ([2, num_layers, num_tokens, hidden]), the paged buffer behind
    `key_value_ptrs[j]` ([2, num_blocks, block_size, heads, head_size]) and
    each token t with slot_mapping[t] >= 0, copy in `direction`.
    """

    layers: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)
    calls: int = 0

    def register(self, kv_caches: list[torch.Tensor]) -> None:
        self.layers = {t.data_ptr(): (i, t) for i, t in enumerate(kv_caches)}

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
        num_tokens = slot_mapping.shape[0]
        assert key_value.shape[1] == key_value_ptrs.shape[0]
        assert key_value.shape[2] == num_tokens
        valid = slot_mapping >= 0
        tokens = torch.nonzero(valid).flatten()
        slots = slot_mapping[valid]
        for j, ptr in enumerate(key_value_ptrs.tolist()):
            layer, paged = self.layers[ptr]
            flat = paged.view(2, page_buffer_size, -1)
            if direction:
                key_value[:, j, tokens] = flat[:, slots]
            else:
                flat[:, slots] = key_value[:, j, tokens]
            self.copies.append(Copy(layer, bool(direction), slots.tolist()))

    def slots_per_layer(self, to_lmcache: bool) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in self.copies:
            if c.to_lmcache == to_lmcache:
                out.setdefault(c.layer, []).extend(c.slots)
        return out

    def reset(self) -> None:
        self.copies.clear()
        self.calls = 0


class _FakeStream:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Replace what needs CUDA, and nothing else."""
    from lmcache.v1 import gpu_connector

    c_ops = FakeCOps()
    monkeypatch.setattr(gpu_connector, "lmc_ops", c_ops, raising=False)
    monkeypatch.setattr(gpu_connector, "_assert_cuda_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return c_ops


@pytest.fixture(scope="session")
def distributed():
    """A one-process vLLM world (gloo): the adapter asks for its TP rank."""
    import socket

    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
    yield


@pytest.fixture
def make_pair(fake_cuda, distributed):
    from s04_lmcache.harness import Pair

    pairs = []

    def make(model: str, hma: bool) -> Pair:
        pair = Pair(model, hma)
        fake_cuda.register(list(pair.kv_caches.values()))
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.shutdown()
