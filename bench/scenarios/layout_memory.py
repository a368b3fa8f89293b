"""Scenario 6: peak blocks per group and admission of the layouts stages declare.

Each layout (``[[bench.layouts]]`` of a stage's ``stage.toml``) is one
single-layer KV cache group per kind it names. For each tree, as the tree's
scheduler calls its ``KVCacheManager``:

* peak: one new request of L + n tokens whose first L tokens a KV connector
  has; the real blocks each group holds right after ``allocate_slots``;
* longest hit: the longest external hit (a multiple of the block size, the
  hits a Mamba group serves) admitted under ``num_blocks`` blocks, a fresh
  manager per probe;
* concurrent: requests with the same external prefix of ``shared_prefix``
  tokens admitted one after another into one manager (one scheduling step:
  nothing is cached while they load).

Where the tree's manager shortens external tokens to what its groups can
serve (``get_num_external_computed_tokens``), the scenario asks it first and
loads what it answers, as the scheduler does. Deterministic; the tool checks
the figures against the physical limit (``hmastack.bench.figures``).
"""

from __future__ import annotations

import math

import _common as c


def loaded(mgr, req, num_local: int, external: int) -> int:
    """The external tokens the tree's scheduler loads of ``external``."""
    shorten = getattr(mgr, "get_num_external_computed_tokens", None)
    return external if shorten is None else shorten(req, num_local, external)


def admit(mgr, req, external: int, new: int):
    """Admit ``req`` with ``external`` tokens from a connector (asynchronous
    load), as the tree's scheduler does; returns (blocks or None, loaded)."""
    _, num_local = mgr.get_computed_blocks(req)
    external = loaded(mgr, req, num_local, external)
    new += req.num_tokens - num_local - external - new
    return c.allocate_with_external(mgr, req, external, new), external


def probe(kinds, B, num_blocks, L, n) -> bool:
    mgr = c.manager(c.kv_cache_config(kinds, 0, B, num_blocks), B, L + n + B)
    blocks, got = admit(mgr, c.request("p", L + n, B), L, n)
    return blocks is not None and got == L


def longest(kinds, B, num_blocks, n) -> int:
    lo, hi = 0, num_blocks  # in blocks: probe(lo) holds, probe(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(kinds, B, num_blocks, mid * B, n):
            lo = mid
        else:
            hi = mid
    return lo * B


def concurrent(kinds, B, num_blocks, L, n, cap=10000) -> int:
    mgr = c.manager(c.kv_cache_config(kinds, 0, B, num_blocks), B, L + n + B)
    count = 0
    while count < cap:
        blocks, _ = admit(mgr, c.request(f"r{count}", L + n, B, salt=0), L, n)
        if blocks is None:
            break
        count += 1
    return count


def main() -> None:
    a = c.args()
    B = int(a.get("block_size", 16))
    n = int(a.get("new_tokens", 1))
    N = int(a.get("num_blocks", 4096))
    prefix = int(a.get("shared_prefix", 8192))
    rows = []
    for layout in a["layouts"]:
        kinds = layout["groups"]
        for L in layout["lengths"]:
            total = math.ceil((L + n) / B)
            mgr = c.manager(
                c.kv_cache_config(kinds, 0, B, len(kinds) * total + 8), B, L + n + B
            )
            blocks, got = admit(mgr, c.request("r0", L + n, B), L, n)
            assert blocks is not None, f"{layout['name']} L={L}: not admitted"
            rows.append(
                {
                    "layout": layout["name"],
                    "figure": "peak",
                    "external": L,
                    "loaded": got,
                    "blocks": c.blocks_per_group(mgr, "r0"),
                }
            )
        rows.append(
            {
                "layout": layout["name"],
                "figure": "longest_hit",
                "value": longest(kinds, B, N, n),
            }
        )
        rows.append(
            {
                "layout": layout["name"],
                "figure": "concurrent",
                "external": prefix,
                "value": concurrent(kinds, B, N, prefix, n),
            }
        )
    c.emit(
        {
            "block_size": B,
            "new_tokens": n,
            "num_blocks": N,
            "shared_prefix": prefix,
            "rows": rows,
            **c.tree_info(),
        }
    )


if __name__ == "__main__":
    main()
