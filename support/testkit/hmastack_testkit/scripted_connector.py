"""The scripted KV connector of the scheduler-level tests and benchmarks.

A connector's scheduler side that moves no data: what it answers at a
lookup, which blocks it loads into, which blocks its stores read and
whether a finished request's free is delayed come from a script, so a test
drives the real ``Scheduler`` through every connector path. The stage-03
state machine and model replays, stage 04's MultiConnector test and the
scheduler-cost benchmark use it, each adding only its own checks.

Loaded by vLLM with ``kv_connector_module_path="hmastack_testkit.
scripted_connector"`` and one of the classes below as ``kv_connector``.
They differ only where vLLM tells connectors apart by their type:

=============================  =================================================
``ScriptedConnector``          ``SupportsHMA`` (gets every KV cache group)
``HoldingScriptedConnector``   the same, overriding ``request_blocks_freed``
                               (the scheduler holds the blocks its stores read)
``PlainScriptedConnector``     no ``SupportsHMA`` (HMA off), holding
``DecliningScriptedConnector`` ``SupportsHMA`` declining HMA for its
                               configuration (``supports_hma_with_config``,
                               which trees from stage 03 on ask), holding
=============================  =================================================

The script (attributes a test sets; the engine-wide defaults come from
``kv_connector_extra_config``):

* ``offers[req_id]`` (else the standing ``offer``: extra config
  ``offer_tokens``, ``load_async``, ``whole_prompt``): the connector holds
  the KV of the request's first ``Offer.tokens`` tokens, or of
  ``Offer.tokens`` tokens past the local hit (``past_hit``);
  :meth:`Offer.external` is the lookup's answer;
* ``stores[req_id]``: the blocks the request's stores still read, until a
  ``finished_sending`` reports the request;
* ``save_req_ids``: requests whose blocks the connector saves when they
  finish holding a block (a delayed free; their blocks in ``saving`` until
  ``finished_sending``). A finished request whose stores still read
  blocks has its free delayed as well.

What it records (unless extra config ``track_blocks`` is false: then only
``calls``, so that a benchmark measures the scheduler, not the double):
``lookups`` (the local hit tokens of each request's last lookup),
``block_tables`` (the block ids of every ``update_state_after_alloc``
since a request's last lookup, appended per group), ``pending`` (asynchronous
loads until ``finished_recving``), ``sync_loads`` (synchronous loads since the
test last cleared it) and ``calls`` (calls of the scripted scheduler-side
methods by name; both finish hooks count as ``request_finished``).

Runs in every tree the benchmarks compare (vLLM 0.13.0, each stage, the
v0.14.0 peer): only ``KVConnectorBase_V1``, ``SupportsHMA`` and the
connector's own configuration are used; a tree without the hook never calls
``request_blocks_freed``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

NULL_BLOCK = 0


@dataclass(frozen=True)
class Offer:
    """The connector holds the KV of a request's first ``tokens`` tokens (or,
    with ``past_hit``, of ``tokens`` tokens past its local hit)."""

    tokens: int = 0
    load_async: bool = False
    # An async load may cover the whole prompt (as a P/D consumer's does: the
    # scheduler computes the last token again); otherwise the last token is
    # left to compute.
    whole_prompt: bool = False
    # ``tokens`` counts the tokens past the local hit, whatever the hit is:
    # the answer as given (a model's event names it), not capped.
    past_hit: bool = False

    def external(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``'s answer: the held tokens past the
        local hit, and whether they load asynchronously (no tokens: no
        load)."""
        if self.past_hit:
            return self.tokens, self.load_async and self.tokens > 0
        whole = self.load_async and self.whole_prompt
        limit = request.num_tokens if whole else request.num_tokens - 1
        num_external = min(self.tokens, limit) - num_computed_tokens
        if num_external <= 0:
            return 0, False
        return num_external, self.load_async


@dataclass
class Load:
    """Blocks a load writes into (per group, the null block left out), and
    the token range it loads."""

    block_ids: tuple[list[int], ...]
    load_async: bool
    start: int
    end: int
    # The connector got the null block for a token of this range.
    null_in_range: bool = False

    def all_block_ids(self) -> set[int]:
        return {b for group in self.block_ids for b in group}


@dataclass
class ScriptedConnectorMetadata(KVConnectorMetadata):
    # The loads started since the last build (request id -> load).
    loads: dict[str, Load] = field(default_factory=dict)


class _Scripted(KVConnectorBase_V1):
    """The scripted scheduler side (see the module's docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.offer = Offer(
            int(extra.get("offer_tokens", 0)),
            bool(extra.get("load_async", False)),
            bool(extra.get("whole_prompt", False)),
        )
        self.track_blocks = bool(extra.get("track_blocks", True))
        self.offers: dict[str, Offer] = {}
        self.stores: dict[str, set[int]] = {}
        self.save_req_ids: set[str] = set()
        self.saving: dict[str, set[int]] = {}
        self.lookups: dict[str, int] = {}
        self.block_tables: dict[str, list[list[int]]] = {}
        self.pending: dict[str, Load] = {}
        self.sync_loads: dict[str, Load] = {}
        self.calls: Counter[str] = Counter()
        self._started: dict[str, Load] = {}

    # -- lookup and allocation ------------------------------------------------

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls["get_num_new_matched_tokens"] += 1
        req_id = request.request_id
        if self.track_blocks:
            # A new lookup (a new request, or one that starts over): its block
            # tables start over.
            self.block_tables.pop(req_id, None)
            self.lookups[req_id] = num_computed_tokens
        return self.offers.get(req_id, self.offer).external(
            request, num_computed_tokens
        )

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.calls["update_state_after_alloc"] += 1
        if not self.track_blocks:
            return
        req_id = request.request_id
        block_ids = blocks.get_block_ids()
        kept = self.block_tables.setdefault(req_id, [[] for _ in block_ids])
        for table, group_block_ids in zip(kept, block_ids, strict=True):
            table.extend(group_block_ids)
        if num_external_tokens == 0:
            return
        start = self.lookups[req_id]
        end = start + num_external_tokens
        sizes = self._block_sizes(len(blocks.blocks))
        spans = [
            group[start // size : -(-end // size)]
            for size, group in zip(sizes, blocks.blocks, strict=True)
        ]
        load = Load(
            tuple([b.block_id for b in span if not b.is_null] for span in spans),
            self.offers.get(req_id, self.offer).load_async,
            start,
            end,
            any(b.is_null for span in spans for b in span),
        )
        self._started[req_id] = load
        if load.load_async:
            assert req_id not in self.pending, f"{req_id} loads twice"
            self.pending[req_id] = load
        else:
            self.sync_loads[req_id] = load

    def _block_sizes(self, num_groups: int) -> list[int]:
        """Each KV cache group's block size (one group: the cache config's,
        as a connector without HMA sees it)."""
        config = getattr(self, "_kv_cache_config", None)
        if config is not None and len(config.kv_cache_groups) == num_groups:
            return [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
        return [self._vllm_config.cache_config.block_size] * num_groups

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.calls["build_connector_meta"] += 1
        meta = ScriptedConnectorMetadata(self._started)
        self._started = {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self.pending.pop(req_id, None)
        for req_id in connector_output.finished_sending or ():
            self.stores.pop(req_id, None)
            self.saving.pop(req_id, None)

    # -- finish ---------------------------------------------------------------

    def _finished(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a request of ``save_req_ids`` that holds a block
        (its blocks go to ``saving``), or of one whose stores still read
        blocks."""
        self.calls["request_finished"] += 1
        req_id = request.request_id
        if req_id in self.save_req_ids and any(block_ids):
            self.saving[req_id] = {
                b for group in block_ids for b in group if b != NULL_BLOCK
            }
            return True, None
        return bool(self.stores.get(req_id)), None

    def _blocks_freed(self, request_id: str, block_ids: list[int]) -> set[int]:
        self.calls["request_blocks_freed"] += 1
        stores = self.stores.get(request_id)
        return stores & set(block_ids) if stores else set()

    # -- worker side: no data moves -------------------------------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class ScriptedConnector(_Scripted, SupportsHMA):
    """The scripted connector with ``SupportsHMA``."""

    def request_finished(self, request, block_ids):
        raise AssertionError("a SupportsHMA connector gets request_finished_all_groups")

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, block_ids)


class HoldingScriptedConnector(ScriptedConnector):
    """Names the blocks its stores read when they leave a block table: the
    scheduler holds them."""

    def request_blocks_freed(self, request_id: str, block_ids: list[int]) -> set[int]:
        return self._blocks_freed(request_id, block_ids)


class PlainScriptedConnector(_Scripted):
    """The scripted connector without ``SupportsHMA`` (vLLM turns HMA off)."""

    def request_finished(
        self, request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, (block_ids,))

    def request_blocks_freed(self, request_id: str, block_ids: list[int]) -> set[int]:
        return self._blocks_freed(request_id, block_ids)


class DecliningScriptedConnector(HoldingScriptedConnector):
    """A ``SupportsHMA`` connector that declines HMA for its configuration:
    it must be treated as one without HMA support."""

    @classmethod
    def supports_hma_with_config(cls, kv_transfer_config) -> bool:
        return False

    def request_finished(
        self, request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        raise AssertionError(
            "a connector that declined HMA got request_finished_all_groups"
        )
