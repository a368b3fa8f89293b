"""Scenario 4: prefix cache hits (tokens) with eagle on hybrid layouts.

A first request's prompt is computed (or loaded by a KV connector, then computed
to its end) and freed, so its blocks stay in the prefix cache; some cached blocks
may be evicted from one KV cache group; then a second request with the same
prompt looks up its prefix cache hit (``get_computed_blocks``), with eagle on and,
for reference, off. Deterministic; runs in the tree's own process.

Cases (P: prompt tokens, B: block size, W: sliding window):

* ``fully cached``: P = 4101; ``fully cached, aligned``: P = 4096;
  ``short prompt``: P = 33 (two blocks and one token);
* ``full block evicted``: block 100 evicted from the full attention group;
* ``SWA block evicted``: in the last sliding window group, the first block of
  the window of the longest hit with eagle of the fully cached prompt
  (block (4080 - W + 1) // B);
* ``connector async`` / ``connector sync``: a KV connector loads the first 4096
  tokens (asynchronously: the blocks are cached when the load finished, then
  the request computes the rest; synchronously: in the step that computes the
  rest).
"""

from __future__ import annotations

import _common as c

P = 4101
EXTERNAL = 4096


def eagle_manager(kinds, W: int, B: int, num_blocks: int, use_eagle: bool):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(
        c.kv_cache_config(kinds, W, B, num_blocks),
        max_model_len=8192,
        hash_block_size=B,
        enable_caching=True,
        use_eagle=use_eagle,
    )


def compute_prompt(mgr, req, external: int, load: str | None, B: int) -> None:
    """Compute ``req``'s prompt as the tree's scheduler would (external tokens
    loaded by a connector first) and free it: its blocks stay cached."""
    n = req.num_tokens
    if load is None:
        computed, num_local = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, n - num_local, num_local, computed) is not None
    elif load == "sync":
        assert c.allocate_with_external(mgr, req, external, n - external, False)
    else:
        assert c.allocate_with_external(mgr, req, external, 0, True)
        mgr.cache_blocks(req, external)  # the load finished
        req.num_computed_tokens = external
        assert mgr.allocate_slots(req, n - external) is not None
    req.num_computed_tokens = n
    mgr.free(req)


def evict(mgr, req, group: int, block: int) -> None:
    pool = mgr.block_pool
    cached = pool.get_cached_block(req.block_hashes[block], [group])
    assert cached is not None, (group, block)
    pool.evict_blocks({cached[0].block_id})


def cases(kinds: list[str], W: int, B: int) -> list[dict]:
    last_swa = max(i for i, k in enumerate(kinds) if k == "swa")
    return [
        {"case": "fully cached", "prompt": P},
        {"case": "fully cached, aligned", "prompt": 4096},
        {"case": "short prompt", "prompt": 33},
        {"case": "full block evicted", "prompt": P, "evict": [[0, 100]]},
        {
            "case": "SWA block evicted",
            "prompt": P,
            "evict": [[last_swa, (4080 - W + 1) // B]],
        },
        {"case": "connector async", "prompt": P, "external": EXTERNAL, "load": "async"},
        {"case": "connector sync", "prompt": P, "external": EXTERNAL, "load": "sync"},
    ]


def run_case(kinds, W: int, B: int, case: dict, use_eagle: bool) -> int:
    num_blocks = len(kinds) * (case["prompt"] // B + 4) + 8
    mgr = eagle_manager(kinds, W, B, num_blocks, use_eagle)
    first = c.request("first", case["prompt"], B, salt=1)
    compute_prompt(mgr, first, case.get("external", 0), case.get("load"), B)
    for group, block in case.get("evict", []):
        evict(mgr, first, group, block)
    second = c.request("second", case["prompt"], B, salt=1)
    return mgr.get_computed_blocks(second)[1]


def main() -> None:
    a = c.args()
    B = int(a.get("block_size", 16))
    rows = []
    for pattern in a.get("patterns", ["gemma3", "gptoss"]):
        kinds = c.pattern_groups(pattern)
        for W in a.get("windows", [128, 512]):
            for case in cases(kinds, W, B):
                rows.append(
                    {
                        "pattern": pattern,
                        "window": W,
                        **case,
                        "hit": run_case(kinds, W, B, case, True),
                        "hit_no_eagle": run_case(kinds, W, B, case, False),
                    }
                )
    c.emit({"block_size": B, "rows": rows, **c.tree_info()})


if __name__ == "__main__":
    main()
