"""Slots loaded per layer for one Gemma-3-like external hit, before and after.

    python before_after.py hma-off   # e.g. the LMCache 0.3.11 tree (HMA off is
                                     # the only way it runs)
    python before_after.py hma-on    # LMCache tree with stage 04

(``PYTHONPATH=<vllm tree>:<lmcache tree>:support/testkit``, in the CPU
environment; python puts this directory first on ``sys.path``.) Same harness
and CUDA boundary as the tests: request A (1100 tokens) is computed and
stored, vLLM's prefix cache is reset, request B shares A's first 1024 tokens
and loads them from LMCache. Prints, for each layer, its
KV cache group's type, how many slots the load wrote for it and which tokens.
"""

from __future__ import annotations

import os
import sys

import conftest
import layouts
import pytest
from harness import Engine
from hmastack_testkit import lmcache_cuda_boundary as cuda_boundary
from layouts import BLOCK_SIZE


def main(mode: str) -> None:
    hma = mode == "hma-on"
    with pytest.MonkeyPatch.context() as mp:
        kernel = cuda_boundary.install(mp)
        next(conftest.distributed.__wrapped__())
        engine = Engine(layouts.gemma3_like(), hma, kernel)
        prefix = list(range(1000, 2024))
        engine.add(prefix + list(range(5000, 5076)))
        engine.run()
        assert engine.scheduler.reset_prefix_cache()
        b = engine.add(prefix + list(range(9000, 9076)))
        engine.step()
        load = engine.loads[b.request_id]
        written = kernel.written_slots()
        print(
            f"mode={mode} groups={len(engine.groups)} "
            f"external_tokens={load.num_external_tokens}"
        )
        total = 0
        for i, (name, buf) in enumerate(engine.buffers.items()):
            g = engine.group_of_layer[name]
            spec = engine.groups[g].kv_cache_spec
            table = load.tables[g]
            slot_to_pos = {
                blk * BLOCK_SIZE + o: j * BLOCK_SIZE + o
                for j, blk in enumerate(table)
                if blk != 0
                for o in range(BLOCK_SIZE)
            }
            mine = written.get(buf.data_ptr(), set()) & set(slot_to_pos)
            pos = sorted(slot_to_pos[s] for s in mine)
            total += len(pos)
            span = f"tokens {pos[0]}..{pos[-1]}" if pos else "-"
            window = getattr(spec, "sliding_window", None)
            print(
                f"layer {i:2d} {type(spec).__name__:18s} window={window!s:5s} "
                f"slots_loaded={len(pos):5d} {span}"
            )
        print(f"total slots loaded: {total}")
        sys.stdout.flush()
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    # LMCache's lookup server keeps non-daemon threads; the tests shut them
    # down with the engine, this script just leaves.
    os._exit(0)
