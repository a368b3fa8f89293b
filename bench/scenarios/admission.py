"""Scenario 2: admission under a fixed KV budget.

The budget is ``num_blocks`` blocks of the hybrid layout (each group's block holds
one group's layers). For each tree:

* ``hma``: the tree's own hybrid manager (one full group + SWA groups);
* ``hma_off``: HMA switched off, one full-attention group whose block holds every
  layer, so the same memory gives ``num_blocks // num_groups`` blocks.

Figures: the longest external hit that is admitted (binary search over L, a fresh
``KVCacheManager`` per probe), and how many requests with the same long external
prefix are admitted together in one scheduling step (one manager, admitted one
after another until ``allocate_slots`` refuses). The physical limit counts, per
SWA group, min(all blocks, ceil((W-1)/B)+1).
"""

from __future__ import annotations

import math

import _common as c


def probe(kinds, W, B, num_blocks, L, n) -> bool:
    mgr = c.manager(c.kv_cache_config(kinds, W, B, num_blocks), B, L + n + B)
    return c.allocate_with_external(mgr, c.request("p", L + n, B), L, n) is not None


def longest(kinds, W, B, num_blocks, n) -> int:
    lo, hi = 0, num_blocks * B  # probe(lo) holds (L=0 needs 1 block), probe(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(kinds, W, B, num_blocks, mid, n):
            lo = mid
        else:
            hi = mid
    return lo


def concurrent(kinds, W, B, num_blocks, L, n, cap=10000) -> int:
    mgr = c.manager(c.kv_cache_config(kinds, W, B, num_blocks), B, L + n + B)
    count = 0
    while count < cap:
        req = c.request(f"r{count}", L + n, B, salt=0)
        if c.allocate_with_external(mgr, req, L, n) is None:
            break
        count += 1
    return count


def physical_blocks(kinds, W, B, L, n) -> int:
    total = math.ceil((L + n) / B)
    return sum(
        total if k == "full" else min(total, c.swa_min_blocks(W, B)) for k in kinds
    )


def physical_longest(kinds, W, B, num_blocks, n) -> int:
    usable = num_blocks - 1  # the null block
    lo, hi = 0, num_blocks * B
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if physical_blocks(kinds, W, B, mid, n) <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    a = c.args()
    B = int(a.get("block_size", 16))
    n = int(a.get("new_tokens", 1))
    N = int(a.get("num_blocks", 4096))
    prefix = int(a.get("shared_prefix", 8192))
    rows = []
    for pattern in a.get("patterns", ["gemma3", "gptoss"]):
        kinds = c.pattern_groups(pattern)
        for W in a.get("windows", [512, 4096]):
            off_blocks = N // len(kinds)
            rows.append(
                {
                    "pattern": pattern,
                    "window": W,
                    "budget_blocks": N,
                    "longest_hit": longest(kinds, W, B, N, n),
                    "longest_hit_hma_off": longest(["full"], W, B, off_blocks, n),
                    "longest_hit_physical": physical_longest(kinds, W, B, N, n),
                    "shared_prefix": prefix,
                    "concurrent": concurrent(kinds, W, B, N, prefix, n),
                    "concurrent_hma_off": concurrent(
                        ["full"], W, B, off_blocks, prefix, n
                    ),
                    "concurrent_physical": (N - 1)
                    // physical_blocks(kinds, W, B, prefix, n),
                }
            )
    mgr = c.manager(c.kv_cache_config(["full"], 512, B, 4), B, 64)
    c.emit(
        {
            "block_size": B,
            "new_tokens": n,
            "separate_external_arg": c.has_external_arg(mgr),
            "rows": rows,
            **c.tree_info(),
        }
    )


if __name__ == "__main__":
    main()
