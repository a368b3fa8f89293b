"""A CPU KV connector for tests: stores whole blocks on disk, loads them back.

Loaded by vLLM with ``kv_connector_module_path="hmastack_testkit.e2e.connector"`` and
``kv_connector`` = ``CPUTestConnector`` (plain: HMA stays off) or
``CPUTestHMAConnector`` (subclasses ``SupportsHMA``: HMA stays on).

Storage: one file per block of the prompt, named by vLLM's block hash
(``request.block_hashes[i].hex()``), holding that block of every attention
layer (``{layer_name: tensor[2, num_kv_heads, block_size, head_size]}``). Whole
blocks only: the CPU attention kernel keeps a K block as ``[head_size,
block_size]`` internally, so a token slice of a block is not what it looks like.
The block hashes depend on ``PYTHONHASHSEED``: a process with another seed
finds nothing (0 external tokens), which the end-to-end checks must notice.

Scheduler side:

* ``get_num_new_matched_tokens`` counts the leading prompt blocks present in the
  store and reports ``min(blocks * block_size, prompt_len - 1, max_hit_tokens)``
  minus the local hit (the last prompt token is always recomputed); loads are
  synchronous or asynchronous (``WAITING_FOR_REMOTE_KVS``) per request;
* ``update_state_after_alloc`` records, per KV cache group, the block ids of the
  external tokens' block positions (the null block where a group skips them);
* ``build_connector_meta`` sends the loads, and the saves of the prompt blocks
  the step completes (positions ``[computed // B, (computed + scheduled) // B)``);
* ``request_finished`` / ``request_finished_all_groups`` may keep the blocks
  (delayed free) for a number of steps.

Worker side: copies whole blocks between the store and each layer's KV cache,
with each layer's KV cache group's block id, skipping the null block (block 0):
it never reads or writes it. It can report load failures (the blocks of chosen
positions, all groups) instead of loading them, and delay async loads.

Per-request behaviour comes from ``kv_transfer_params`` (``SamplingParams.extra_args
["kv_transfer_params"]`` or the server's request field):

======================  ==========================================================
``load``                ``"sync"`` (default), ``"async"``, or ``"none"`` (no hit)
``load_delay_steps``    async: the load completes after this many worker steps
``max_hit_tokens``      cap on the external hit (a hit may end inside a block)
``fail_positions``      block positions whose load fails (reported as invalid)
``fail_times``          how many load attempts of the request fail (default 1)
``save``                store this request's prompt blocks (default true)
``delay_free_steps``    keep the blocks this many steps after the request ends
``namespace``           the store's subfolder (default ``default``)
``skip_group``          negative control: do not load KV cache group G
``skip_layer``          negative control with one group (HMA off): skip layer L
======================  ==========================================================

Engine-wide (``kv_connector_extra_config``): ``store_dir`` (required).

Every instance registers itself in :data:`INSTANCES` so a driver in the same
process (engine core in-process) can read the statistics it kept.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

NULL_BLOCK = 0
INSTANCES: weakref.WeakSet = weakref.WeakSet()


@dataclass
class BlockCopy:
    """One block position of one request: its hash (file name) and the block id
    in each KV cache group (``NULL_BLOCK`` where the group skips it)."""

    position: int
    block_hash: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    blocks: list[BlockCopy]
    is_async: bool
    delay_steps: int = 0
    fail_positions: list[int] = field(default_factory=list)
    fail_times: int = 1
    skip_group: int | None = None
    skip_layer: int | None = None


@dataclass
class SaveSpec:
    req_id: str
    blocks: list[BlockCopy]


@dataclass
class TestConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # req_id -> (steps to keep, block ids per group) for delayed frees
    delayed_frees: dict[str, tuple[int, list[list[int]]]] = field(default_factory=dict)


@dataclass
class Stats:
    """What a connector instance did (read by the driver, in-process)."""

    hits: dict[str, int] = field(default_factory=dict)  # req_id -> tokens
    load_blocks_per_group: dict[str, list[int]] = field(default_factory=dict)
    null_blocks_skipped_per_group: dict[str, list[int]] = field(default_factory=dict)
    saved_blocks: int = 0
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    delayed_frees: int = 0
    findings: list[str] = field(default_factory=list)


class CPUTestConnector(KVConnectorBase_V1):
    """The plain flavour (no ``SupportsHMA``): vLLM turns HMA off with it."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.store = Path(extra["store_dir"])
        self.store.mkdir(parents=True, exist_ok=True)
        self.block_size = vllm_config.cache_config.block_size
        self.stats = Stats()
        assert kv_cache_config is not None, "needs vLLM >= 0.13 (kv_cache_config)"
        self.groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        self.layer_group = {
            name: g for g, names in enumerate(self.groups) for name in names
        }
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._params: dict[str, dict] = {}
        self._local: dict[str, int] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_frees: dict[str, tuple[int, list[list[int]]]] = {}
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._async_loads: list[LoadSpec] = []
        self._invalid: set[int] = set()
        self._held: dict[str, list] = {}  # req_id -> [steps left, blocks, digest]
        self._failed_attempts: dict[str, int] = {}
        INSTANCES.add(self)

    # --- helpers -----------------------------------------------------------------

    def _file(self, block_hash: str) -> Path:
        """``block_hash`` is ``<namespace>/<hash hex>``."""
        return self.store / f"{block_hash}.pt"

    def _key(self, request: Request, position: int) -> str:
        params = self._params.get(request.request_id) or {}
        namespace = str(params.get("namespace", "default"))
        return f"{namespace}/{bytes(request.block_hashes[position]).hex()}"

    def _stored_prefix_blocks(self, request: Request) -> int:
        n = 0
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        for p in range(min(num_prompt_blocks, len(request.block_hashes))):
            if not self._file(self._key(request, p)).is_file():
                break
            n += 1
        return n

    # --- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        self._requests[request.request_id] = request
        self._params[request.request_id] = params
        mode = params.get("load", "sync")
        if mode == "none":
            return 0, False
        hit = self._stored_prefix_blocks(request) * self.block_size
        hit = min(hit, request.num_prompt_tokens - 1)
        if params.get("max_hit_tokens") is not None:
            hit = min(hit, int(params["max_hit_tokens"]))
        external = max(0, hit - num_computed_tokens)
        self._local[request.request_id] = num_computed_tokens
        self.stats.hits[request.request_id] = external
        return external, external > 0 and mode == "async"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        req_id = request.request_id
        tables = [list(t) for t in blocks.get_block_ids()]
        self._tables[req_id] = tables
        if num_external_tokens == 0:
            return
        params = self._params.get(req_id, {})
        local = self._local.get(req_id, 0)
        first = local // self.block_size
        last = -(-(local + num_external_tokens) // self.block_size)
        copies = []
        for p in range(first, last):
            ids = [t[p] if p < len(t) else NULL_BLOCK for t in tables]
            copies.append(BlockCopy(p, self._key(request, p), ids))
        self._pending_loads.append(
            LoadSpec(
                req_id,
                copies,
                is_async=params.get("load", "sync") == "async",
                delay_steps=int(params.get("load_delay_steps", 0)),
                fail_positions=[int(x) for x in params.get("fail_positions", [])],
                fail_times=int(params.get("fail_times", 1)),
                skip_group=params.get("skip_group"),
                skip_layer=params.get("skip_layer"),
            )
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = TestConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.delayed_frees, self._pending_frees = self._pending_frees, {}
        for new_req in scheduler_output.scheduled_new_reqs:
            self._tables[new_req.req_id] = [list(t) for t in new_req.block_ids]
            self._add_save(
                meta,
                new_req.req_id,
                new_req.num_computed_tokens,
                scheduler_output.num_scheduled_tokens[new_req.req_id],
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                self._tables[req_id] = [list(t) for t in new_ids]
            elif new_ids is not None and req_id in self._tables:
                for table, ids in zip(self._tables[req_id], new_ids, strict=False):
                    table.extend(ids)
            self._add_save(
                meta,
                req_id,
                cached.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens[req_id],
            )
        return meta

    def _add_save(
        self, meta: TestConnectorMetadata, req_id: str, computed: int, scheduled: int
    ) -> None:
        request = self._requests.get(req_id)
        tables = self._tables.get(req_id)
        params = self._params.get(req_id, {})
        if request is None or tables is None or not params.get("save", True):
            return
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        first = computed // self.block_size
        last = min((computed + scheduled) // self.block_size, num_prompt_blocks)
        copies = []
        for p in range(first, last):
            ids = [t[p] if p < len(t) else NULL_BLOCK for t in tables]
            block_hash = self._key(request, p)
            if NULL_BLOCK in ids:
                # A block computed in this step is real in every group.
                self.stats.findings.append(
                    f"{req_id}: block position {p} computed in this step is the "
                    f"null block in a group: {ids}"
                )
                continue
            if not self._file(block_hash).is_file():
                copies.append(BlockCopy(p, block_hash, ids))
        if copies:
            meta.saves.append(SaveSpec(req_id, copies))

    def _finished(self, request: Request, tables: list[list[int]]) -> bool:
        req_id = request.request_id
        params = self._params.pop(req_id, {})
        self._requests.pop(req_id, None)
        self._tables.pop(req_id, None)
        self._local.pop(req_id, None)
        steps = int(params.get("delay_free_steps", 0))
        if steps <= 0:
            return False
        self._pending_frees[req_id] = (steps, [list(t) for t in tables])
        self.stats.delayed_frees += 1
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(block_ids)]), None

    # --- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.kv_caches = kv_caches
        for name in kv_caches:
            if name not in self.layer_group:
                self.stats.findings.append(f"layer {name} is in no KV cache group")

    def _layers(self, group: int, spec: LoadSpec) -> list[str]:
        """The layers of ``group`` a load writes (all but the negative
        control's skipped layer, which applies when there is one group)."""
        names = self.groups[group]
        if spec.skip_layer is not None and len(self.groups) == 1:
            names = [n for i, n in enumerate(names) if i != spec.skip_layer]
        return names

    def _load(self, spec: LoadSpec) -> None:
        per_group = self.stats.load_blocks_per_group.setdefault(
            spec.req_id, [0] * len(self.groups)
        )
        nulls = self.stats.null_blocks_skipped_per_group.setdefault(
            spec.req_id, [0] * len(self.groups)
        )
        attempt = self._failed_attempts.get(spec.req_id, 0)
        fail = [p for p in spec.fail_positions if attempt < spec.fail_times]
        if fail:
            self._failed_attempts[spec.req_id] = attempt + 1
        for copy in spec.blocks:
            if copy.position in fail:
                failed = [b for b in copy.block_ids if b != NULL_BLOCK]
                self._invalid.update(failed)
                self.stats.failed_loads.setdefault(spec.req_id, []).extend(failed)
                continue
            data = torch.load(self._file(copy.block_hash), weights_only=True)
            for g, block_id in enumerate(copy.block_ids):
                if block_id == NULL_BLOCK:
                    nulls[g] += 1
                    continue
                if g == spec.skip_group and len(self.groups) > 1:
                    continue
                per_group[g] += 1
                for name in self._layers(g, spec):
                    self.kv_caches[name][:, block_id].copy_(data[name])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TestConnectorMetadata)
        for spec in meta.loads:
            if spec.is_async:
                self._async_loads.append(spec)
            else:
                self._load(spec)
        for req_id, (steps, tables) in meta.delayed_frees.items():
            self._held[req_id] = [steps, tables, self._digest(tables)]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, TestConnectorMetadata)
        for spec in meta.saves:
            for copy in spec.blocks:
                data = {}
                for g, block_id in enumerate(copy.block_ids):
                    for name in self.groups[g]:
                        data[name] = self.kv_caches[name][:, block_id].clone()
                self._file(copy.block_hash).parent.mkdir(exist_ok=True)
                tmp = self._file(copy.block_hash).with_suffix(f".tmp{os.getpid()}")
                torch.save(data, tmp)
                tmp.rename(self._file(copy.block_hash))
                self.stats.saved_blocks += 1

    def _digest(self, tables: list[list[int]]) -> str:
        h = hashlib.sha256()
        for g, table in enumerate(tables):
            for block_id in table:
                if block_id == NULL_BLOCK:
                    continue
                for name in self.groups[g]:
                    h.update(self.kv_caches[name][:, block_id].numpy().tobytes())
        return h.hexdigest()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        done_recving = set()
        still = []
        for spec in self._async_loads:
            if spec.delay_steps > 0:
                spec.delay_steps -= 1
                still.append(spec)
                continue
            self._load(spec)
            done_recving.add(spec.req_id)
        self._async_loads = still
        done_sending = set()
        for req_id, held in list(self._held.items()):
            held[0] -= 1
            if held[0] > 0:
                continue
            if self._digest(held[1]) != held[2]:
                self.stats.findings.append(
                    f"{req_id}: blocks held by the connector (delayed free) were "
                    "overwritten before it released them"
                )
            del self._held[req_id]
            done_sending.add(req_id)
        return done_sending or None, done_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


class CPUTestHMAConnector(CPUTestConnector, SupportsHMA):
    """The HMA flavour: ``SupportsHMA``, so HMA stays on with it."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(t) for t in block_ids]), None
