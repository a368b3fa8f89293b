"""What vLLM's OffloadingConnector did per request: the external tokens its
lookup offered, the GPU blocks per KV cache group it loaded and stored, the
blocks its hold kept (``request_blocks_freed``), and what the CPU test spec
found in its stores (``hmastack_testkit.offloading.FINDINGS``).

The engine core runs in the driver's process, so the connector's classes are
wrapped here (:func:`install`, before the engine is built) and read by the
driver after each scenario. :func:`disable_hold` is the negative control's
connector: ``request_blocks_freed`` returns no block until it is given back.
"""

from __future__ import annotations

from collections.abc import Callable

# request id -> external tokens offered (the last lookup's), GPU blocks per
# KV cache group loaded / stored, blocks the hold kept
EXTERNAL: dict[str, int] = {}
LOADED: dict[str, list[int]] = {}
STORED: dict[str, list[int]] = {}
HELD: dict[str, int] = {}


def _per_group(gpu_spec) -> list[int]:
    """Blocks per KV cache group of a GPU spec (one group: no group_ids)."""
    group_ids = getattr(gpu_spec, "group_ids", None)
    if group_ids is None:
        return [len(gpu_spec.block_ids)]
    counts = [0] * (int(group_ids.max()) + 1 if len(group_ids) else 0)
    for g in group_ids:
        counts[int(g)] += 1
    return counts


def _add(table: dict[str, list[int]], req_id: str, counts: list[int]) -> None:
    old = table.get(req_id, [])
    n = max(len(old), len(counts))
    old, counts = old + [0] * (n - len(old)), counts + [0] * (n - len(counts))
    table[req_id] = [a + b for a, b in zip(old, counts, strict=True)]


def install() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as oc

    sched = oc.OffloadingConnectorScheduler
    if getattr(sched, "_hmastack_observed", False):
        return
    lookup = sched.get_num_new_matched_tokens

    def observed_lookup(self, request, num_computed_tokens):
        result = lookup(self, request, num_computed_tokens)
        EXTERNAL[request.request_id] = result[0]
        return result

    sched.get_num_new_matched_tokens = observed_lookup
    sched._hmastack_observed = True

    worker = oc.OffloadingConnectorWorker
    start_load, start_store = worker.start_load_kv, worker.start_store_kv

    def observed_start_load(self, metadata):
        for req_id, (_, dst) in metadata.reqs_to_load.items():
            _add(LOADED, req_id, _per_group(dst))
        return start_load(self, metadata)

    def observed_start_store(self, metadata):
        for req_id, (src, _) in metadata.reqs_to_store.items():
            _add(STORED, req_id, _per_group(src))
        return start_store(self, metadata)

    worker.start_load_kv = observed_start_load
    worker.start_store_kv = observed_start_store

    conn = oc.OffloadingConnector
    freed = getattr(conn, "request_blocks_freed", None)
    if freed is not None:

        def observed_freed(self, request_id, block_ids):
            held = freed(self, request_id, block_ids)
            HELD[request_id] = HELD.get(request_id, 0) + len(held)
            return held

        conn.request_blocks_freed = observed_freed


def disable_hold() -> Callable[[], None]:
    """The negative control: the connector holds no block for its stores.
    Returns the function that gives the hold back. (The scheduler side is
    patched: the scheduler takes the connector's bound ``request_blocks_freed``
    when it is built.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as oc

    sched = oc.OffloadingConnectorScheduler
    kept = sched.__dict__["request_blocks_freed"]

    def no_hold(self, request_id, block_ids):
        return set()

    sched.request_blocks_freed = no_hold

    def restore() -> None:
        sched.request_blocks_freed = kept

    return restore


def view(first_id: int, seen_findings: int) -> tuple[dict, int]:
    """The driver's ``connector`` entry for the requests the session made
    since ``first_id`` (ids ``key#n``; keys without the suffix), and the
    number of the spec's findings seen so far."""
    from hmastack_testkit import offloading

    def mine(table: dict) -> dict:
        return {
            r.split("#")[0]: v
            for r, v in table.items()
            if int(r.rsplit("#", 1)[1]) >= first_id
        }

    findings = list(offloading.FINDINGS)
    return {
        "external_tokens": mine(EXTERNAL),
        "loaded_blocks_per_group": mine(LOADED),
        "stored_blocks_per_group": mine(STORED),
        "held_blocks": mine(HELD),
        "findings": findings[seen_findings:],
    }, len(findings)
