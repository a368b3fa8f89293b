"""Helpers shared by the scenario scripts.

These scripts run INSIDE one vLLM tree's process: the tree is on PYTHONPATH and
the interpreter is build/env/bin/python. They only import vLLM's public v1 core
classes and its test helpers, so the same script runs on the base (v0.13.0), on
every stage and on the v0.14.0 peer. Results go to stdout as one line starting
with ``MARKER`` (vLLM may log to stdout too).
"""

from __future__ import annotations

import inspect
import json
import sys

from hmastack_testkit.window import window_min_blocks

MARKER = "HMASTACK_BENCH_JSON "


def emit(payload: dict) -> None:
    sys.stdout.write("\n" + MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def args() -> dict:
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def swa_min_blocks(window: int, block_size: int) -> int:
    """The physical minimum of one SWA group: ceil((W-1)/B)+1 blocks
    (``hmastack_testkit.window``)."""
    return window_min_blocks(window, block_size)


def pattern_groups(pattern: str) -> list[str]:
    """Group kinds of a model pattern as vLLM's HMA groups them.

    ``gemma3``: 5 sliding-window layers per full-attention layer, grouped by equal
    layer counts: one full group and five SWA groups. ``gptoss``: alternating
    layers: one full group and one SWA group.
    """
    return {"gemma3": ["full"] + ["swa"] * 5, "gptoss": ["full", "swa"]}[pattern]


def kv_cache_config(kinds: list[str], window: int, block_size: int, num_blocks: int):
    """The scheduler's KVCacheConfig of one single-layer group per kind ("full"
    or "swa", as :func:`pattern_groups` names them), the testkit's builder."""
    from hmastack_testkit.kv_layouts import make_kv_cache_config

    spec_kinds = [{"swa": "sliding_window"}.get(k, k) for k in kinds]
    return make_kv_cache_config(spec_kinds, block_size, window, num_blocks)


def manager(config, block_size: int, max_model_len: int):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        hash_block_size=block_size,
        enable_caching=True,
    )


_none_hash_ready = False


def request(request_id: str, num_tokens: int, block_size: int, salt: int = 0):
    """A fresh request of ``num_tokens`` distinct prompt tokens."""
    global _none_hash_ready
    from hmastack_testkit.kv_layouts import make_request

    if not _none_hash_ready:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash

        init_none_hash(sha256)
        _none_hash_ready = True
    tokens = [(salt * 7919 + i) % 50000 + 1 for i in range(num_tokens)]
    return make_request(request_id, tokens, block_size, max_tokens=16)


def has_external_arg(mgr) -> bool:
    """Whether ``allocate_slots`` takes external tokens separately (stage 3+)."""
    return (
        "num_external_computed_tokens"
        in inspect.signature(mgr.allocate_slots).parameters
    )


def allocate_with_external(mgr, req, external: int, new: int, load_async: bool = True):
    """Admit a new request whose first ``external`` tokens a connector loads
    (asynchronously: nothing is cached until the load finished).

    The call the scheduler of the tree makes: before stage 3 (and on 0.13.0)
    external tokens go through ``num_new_tokens``; with the separate argument
    they go through ``num_external_computed_tokens``. Returns the blocks or None.
    """
    computed, num_local = mgr.get_computed_blocks(req)
    if has_external_arg(mgr):
        return mgr.allocate_slots(
            req,
            new,
            num_local,
            computed,
            num_external_computed_tokens=external,
            delay_cache_blocks=load_async,
        )
    return mgr.allocate_slots(
        req, new + external, num_local, computed, delay_cache_blocks=load_async
    )


def blocks_per_group(mgr, request_id: str) -> list[int]:
    """Real (non-null) blocks the request holds in each group."""
    return [
        sum(1 for b in m.req_to_blocks.get(request_id, []) if not b.is_null)
        for m in mgr.coordinator.single_type_managers
    ]


def tree_info() -> dict:
    import vllm

    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "vllm_file": vllm.__file__,
    }
