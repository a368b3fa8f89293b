"""Scenario 1: peak blocks per KV cache group for one request with an external hit.

One new request of L + n tokens; a KV connector has the first L tokens (the
external hit), n are computed this step. The figure is what the request holds
right after ``allocate_slots`` (before any later ``remove_skipped_blocks``): the
peak. Deterministic; runs in the tree's own process.
"""

from __future__ import annotations

import math

import _common as c


def main() -> None:
    a = c.args()
    B = int(a.get("block_size", 16))
    n = int(a.get("new_tokens", 1))
    rows = []
    separate = None
    for pattern in a.get("patterns", ["gemma3", "gptoss"]):
        kinds = c.pattern_groups(pattern)
        for W in a.get("windows", [512, 4096]):
            for L in a.get("lengths", [1024, 8192, 32768, 131072]):
                total = math.ceil((L + n) / B)
                num_blocks = len(kinds) * total + 8
                mgr = c.manager(
                    c.kv_cache_config(kinds, W, B, num_blocks), B, L + n + B
                )
                separate = c.has_external_arg(mgr)
                free0 = mgr.block_pool.get_num_free_blocks()
                req = c.request("r0", L + n, B)
                got = c.allocate_with_external(mgr, req, L, n)
                assert got is not None, f"{pattern} W={W} L={L}: not admitted"
                per = c.blocks_per_group(mgr, "r0")
                swa = [x for k, x in zip(kinds, per, strict=True) if k == "swa"]
                rows.append(
                    {
                        "pattern": pattern,
                        "window": W,
                        "external": L,
                        "new": n,
                        "full_blocks": per[kinds.index("full")],
                        "swa_blocks": max(swa),
                        "swa_groups": len(swa),
                        "swa_min": c.swa_min_blocks(W, B),
                        "pool_taken": free0 - mgr.block_pool.get_num_free_blocks(),
                    }
                )
    c.emit(
        {
            "block_size": B,
            "separate_external_arg": separate,
            "rows": rows,
            **c.tree_info(),
        }
    )


if __name__ == "__main__":
    main()
