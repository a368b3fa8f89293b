"""A scripted KV connector for the scheduler-cost scenario (scheduler side only).

It moves no data. For every new request it reports the same external hit, the
first ``hit_tokens`` prompt tokens (at most the prompt less one token), loaded
synchronously (``load_kv_async`` False), so the scheduler takes the path a real
connector's cache hit takes: external tokens counted as computed, their blocks
allocated in the same step, connector metadata built every step and the
finish hook called when a request ends. ``hit_tokens = 0`` is a connector that
never hits.

It uses only what vLLM 0.13.0 and 0.14.0 both have (``KVConnectorBase_V1``,
``SupportsHMA``, the ``kv_connector_module_path`` lookup), so the same file runs
on the base, on every stage and on the peer. It subclasses ``SupportsHMA``
(``request_finished_all_groups``) so that no tree refuses it because of HMA;
whether HMA stays on is each tree's own default, which the scenario records.
With the single full-attention group of ``create_scheduler`` the two settings
use the same KV cache coordinator.

``BenchHookConnector`` is the same connector with a ``request_blocks_freed``
hook that holds nothing: a tree that has the hook asks it about the blocks
leaving a sliding window and those of a finished request; a tree without it
never calls it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

MODULE = "_bench_connector"
NAME = "BenchConnector"
HOOK_NAME = "BenchHookConnector"


class BenchConnectorMetadata(KVConnectorMetadata):
    def __init__(self, loads: dict[str, int]):
        self.loads = loads  # request id -> external tokens it loads this step


class BenchConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.hit_tokens = int(extra.get("hit_tokens", 0))
        self._pending: dict[str, int] = {}
        self.calls = {"matched": 0, "alloc": 0, "meta": 0, "finished": 0}

    # --- scheduler side -------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls["matched"] += 1
        hit = min(self.hit_tokens, request.num_prompt_tokens - 1)
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.calls["alloc"] += 1
        if num_external_tokens > 0:
            self._pending[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.calls["meta"] += 1
        meta = BenchConnectorMetadata(self._pending)
        self._pending = {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.calls["finished"] += 1
        return False, None

    def request_finished_all_groups(
        self, request, block_ids
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls["finished"] += 1
        return False, None

    # --- worker side: never called in the scheduler process -------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class BenchHookConnector(BenchConnector):
    """A connector whose stores never outlive their step, with the hook."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls["freed"] = 0

    def request_blocks_freed(self, request_id: str, block_ids: list[int]) -> set[int]:
        self.calls["freed"] += 1
        return set()
