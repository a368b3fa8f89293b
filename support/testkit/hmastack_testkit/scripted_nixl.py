"""NixlConnector's worker side, scripted: the boundary of a scheduler-level
test whose P/D transfers are part of the script (stage 08's cross-stage state
machine). The scheduler sides of both engines are vLLM's NixlConnector; a
test finishes or fails each consumer's read and lets the producer expire a
request, and the scripted worker sides report that as NixlConnectorWorker
does (`get_finished`, `get_block_ids_with_load_errors`). Real NIXL agents
over UCX run in the worker-level tests.

Loaded by vLLM as a connector class (registered by the test with
``KVConnectorFactory``, e.g. inside a worker-side MultiConnector): it is
``SupportsHMA`` and has no scheduler side.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
    NixlConnectorMetadata,
)


class PDLink:
    """What the two engines of a P/D pair share: the producer's worker side,
    which a consumer's finished read notifies (NIXL's notification)."""

    def __init__(self) -> None:
        self.producer: ScriptedNixlWorker | None = None


class ScriptedNixlWorker(KVConnectorBase_V1, SupportsHMA):
    """NixlConnector's worker side as a test scripts it. It reads
    `NixlConnectorMetadata` as NixlConnectorWorker does: a consumer's reads
    start (an unreadable one is every local block failed, a read of no local
    block only notifies the producer), a producer's finished requests wait
    for their reads; `get_finished` reports what the machine finished."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.link: PDLink | None = None
        # consumer: request id -> ReqMeta of the reads that run
        self.reads: dict[str, Any] = {}
        self.done_recving: set[str] = set()
        self.invalid: set[int] = set()
        # producer: requests waiting for a read, and those to report
        self.to_send: set[str] = set()
        self.done_sending: set[str] = set()
        self.notified: set[str] = set()

    # -- what the machine does
    def finish_read(self, req_id: str) -> None:
        meta = self.reads.pop(req_id)
        self.done_recving.add(req_id)
        self._notify(meta.remote.request_id)

    def fail_read(self, req_id: str) -> None:
        meta = self.reads.pop(req_id)
        self.invalid.update(meta.local_block_ids)
        self.done_recving.add(req_id)

    def expire(self, req_id: str) -> None:
        self.to_send.discard(req_id)
        self.done_sending.add(req_id)

    def _notify(self, remote_req_id: str) -> None:
        assert self.link is not None and self.link.producer is not None
        self.link.producer.notified.add(remote_req_id)

    # -- the worker side
    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NixlConnectorMetadata)
        for req_id, req_meta in meta.reqs_to_recv.items():
            if req_meta.unreadable:
                self.invalid.update(req_meta.local_block_ids)
                self.done_recving.add(req_id)
            elif not req_meta.local_block_ids:
                self._notify(req_meta.remote.request_id)
            else:
                self.reads[req_id] = req_meta
        self.to_send.update(meta.reqs_to_send)

    def get_finished(self, finished_req_ids: set[str]):
        sending = (self.notified & self.to_send) | self.done_sending
        self.to_send -= sending
        self.notified -= sending
        self.done_sending.clear()
        recving, self.done_recving = self.done_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # -- no scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise AssertionError("a worker side")

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        raise AssertionError("a worker side")

    def build_connector_meta(self, scheduler_output):
        raise AssertionError("a worker side")

    def request_finished_all_groups(self, request, block_ids):
        raise AssertionError("a worker side")
