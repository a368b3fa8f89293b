"""Slots loaded per layer for one Gemma-3-like external hit, before and after.

    python before_after.py hma-off   # LMCache 0.3.11 tree (the only way it runs)
    python before_after.py hma-on    # LMCache tree with stage 04

Same harness and fakes as the tests (conftest.py): request A (1100 tokens)
is computed and stored, request B shares its first 1024 tokens and loads them
from LMCache. Prints, for each layer, its attention type, how many slots were
loaded and which token positions they hold.

LMCache 0.3.11 has no `_assert_cuda_device`: there, the connector's inline
CUDA check is left out by running its pointer set-up without it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from s04_lmcache import conftest  # noqa: E402  (sets LMCache's env config)
from s04_lmcache.harness import BLOCK_SIZE, Pair  # noqa: E402


def _pointers_without_device_check(self, kv_caches):
    """LMCache 0.3.11's _initialize_pointers minus its CUDA assertion."""
    self.device = kv_caches[0].device
    idx = self.device.index
    if idx in self.kv_cache_pointers_on_gpu:
        return self.kv_cache_pointers_on_gpu[idx]
    self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
    self.kv_cache_pointers_on_gpu[idx] = self.kv_cache_pointers.clone()
    self.page_buffer_size = kv_caches[0].shape[1] * kv_caches[0].shape[2]
    return self.kv_cache_pointers_on_gpu[idx]


def main(mode: str) -> None:
    from lmcache.v1 import gpu_connector

    hma = mode == "hma-on"
    c_ops = conftest.FakeCOps()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_connector, "lmc_ops", c_ops, raising=False)
        if hasattr(gpu_connector, "_assert_cuda_device"):
            mp.setattr(gpu_connector, "_assert_cuda_device", lambda d: None)
        else:
            mp.setattr(
                gpu_connector.VLLMPagedMemGPUConnectorV2,
                "_initialize_pointers",
                _pointers_without_device_check,
            )
        mp.setattr(torch.cuda, "Stream", conftest._FakeStream)
        mp.setattr(torch.cuda, "stream", lambda s: conftest.contextlib.nullcontext())
        conftest.distributed.__wrapped__().__next__()

        pair = Pair("gemma3-like", hma=hma)
        c_ops.register(list(pair.kv_caches.values()))
        prefix = list(range(1000, 2024))
        a = pair.add_request(prefix + list(range(5000, 5076)))
        pair.schedule_new(a)
        pair.step({a.request_id: a.num_tokens})
        c_ops.reset()
        b = pair.add_request(prefix + list(range(9000, 9076)))
        n = pair.schedule_new(b)
        pair.step({b.request_id: b.num_tokens - n})
        loaded = c_ops.slots_per_layer(to_lmcache=False)
        print(f"mode={mode} groups={len(pair.specs)} external_tokens={n}")
        for i, layer in enumerate(pair.layer_names()):
            spec = pair.specs[pair.group_of_layer[layer]]
            kind = type(spec).__name__
            window = getattr(spec, "sliding_window", None)
            table = pair.running[b.request_id].block_tables[pair.group_of_layer[layer]]
            slot_to_pos = {
                blk * BLOCK_SIZE + o: j * BLOCK_SIZE + o
                for j, blk in enumerate(table)
                for o in range(BLOCK_SIZE)
            }
            pos = sorted(slot_to_pos[s] for s in loaded.get(i, []))
            span = f"tokens {pos[0]}..{pos[-1]}" if pos else "-"
            print(
                f"layer {i:2d} {kind:18s} window={window!s:5s} "
                f"slots_loaded={len(pos):5d} {span}"
            )
        sys.stdout.flush()
        pair.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    # LMCache's servers keep non-daemon threads; the tests shut them down.
    os._exit(0)
