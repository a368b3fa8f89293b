"""What the NixlConnector worker of a P/D consumer did per request: the local
blocks it read and the ones it reported as failed loads.

The engine core runs in the driver's process, so the worker is wrapped here
(:func:`install`, before the engine is built) and read by the driver after
each scenario.
"""

from __future__ import annotations

# request id -> local blocks read without error / reported as failed loads
READ: dict[str, int] = {}
FAILED: dict[str, list[int]] = {}


def install() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import nixl_connector

    worker = nixl_connector.NixlConnectorWorker
    if getattr(worker, "_hmastack_observed", False):
        return
    get_finished = worker.get_finished

    def observed_get_finished(self):
        # The request's blocks, before get_finished drops its metadata.
        blocks = {
            req_id: list(meta.local_block_ids)
            for req_id, meta in self._recving_metadata.items()
        }
        done_sending, done_recving = get_finished(self)
        invalid = set(self._invalid_block_ids)  # what the next report holds
        for req_id in done_recving:
            local = blocks.get(req_id, [])
            failed = sorted(set(local) & invalid)
            READ[req_id] = READ.get(req_id, 0) + len(local) - len(failed)
            if failed:
                FAILED.setdefault(req_id, []).extend(failed)
        return done_sending, done_recving

    worker.get_finished = observed_get_finished
    worker._hmastack_observed = True


def view(first_id: int) -> dict:
    """The driver's ``connector`` entry for the requests the session made
    since ``first_id`` (ids ``key#n``; keys without the suffix)."""

    def mine(req_id: str) -> bool:
        return int(req_id.rsplit("#", 1)[1]) >= first_id

    return {
        "nixl_blocks_read": {r.split("#")[0]: n for r, n in READ.items() if mine(r)},
        "failed_loads": {
            r.split("#")[0]: b for r, b in FAILED.items() if mine(r) and b
        },
    }
