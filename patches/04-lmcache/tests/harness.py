"""vLLM's scheduler and LMCache's connector around a model that is not run.

:class:`Engine` is vLLM's engine loop in one process without the model:

- vLLM's ``Scheduler`` (stages 01-03) with its KV cache manager and its
  ``LMCacheConnectorV1`` in the scheduler role, over the scheduler's
  ``KVCacheConfig`` of a model-like layout (``layouts.py``, vLLM's grouping);
- vLLM's ``LMCacheConnectorV1`` in the worker role over the worker's config,
  LMCache's adapter, its ``LMCacheEngine`` (local CPU backend, lookup client
  and server) and ``VLLMPagedMemGPUConnectorV2``, copying between LMCache and
  paged KV buffers laid out as vLLM lays them out (layers of several KV cache
  groups share a buffer with HMA);
- the model is replaced by :meth:`Engine.forward`: each computed token gets, in
  each layer, a K and V that depend only on the layer and on the tokens up to
  it (:func:`kv_value`), as a real model's would. Before each step,
  :meth:`Engine.check_reads` checks that every token the step's attention
  reads (by the layer's attention type) holds that value, in a real block;
- only the CUDA boundary is faked (``hmastack_testkit.lmcache_cuda_boundary``).

Each :meth:`Engine.step` runs what vLLM's engine core and model runner run:
``schedule()``, the worker's ``start_load_kv``, the forward pass,
``wait_for_save``, ``update_from_output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hmastack_testkit import lmcache_cuda_boundary as cuda_boundary
from hmastack_testkit.kvtest import make_request, make_scheduler, model_runner_output
from layouts import (
    BLOCK_SIZE,
    Layout,
    kv_cache_configs,
    layout_vllm_config,
    paged_buffers,
    spec_of_layer,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

_HASH_MOD = 1 << 19
# What vLLM's null block (block 0) holds here: garbage as far as LMCache is
# concerned. A store that reads it or a load that writes it shows.
NULL_BLOCK_SENTINEL = -12345.0


def prefix_hashes(token_ids: list[int]) -> list[int]:
    """A hash of tokens [0, p] for each position p, in [1, 2**19]."""
    out, h = [], 0
    for t in token_ids:
        h = (h * 1000003 + t + 1) % _HASH_MOD
        out.append(h + 1)
    return out


def kv_value(prefix_hash: int, layer: int) -> float:
    """The K of a token in a layer (V is its negative): exact in float32."""
    return float(prefix_hash) + layer / 16


def first_read_position(spec: KVCacheSpec, position: int) -> int:
    """The first token a token at ``position`` attends to (tokens)."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, position - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return position // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


class _Layer:
    """What the adapter reads from vLLM's forward context: ``kv_cache``, and
    ``kv_sharing_target_layer_name`` as vLLM's ``Attention`` has it."""

    def __init__(self, kv_cache: torch.Tensor, kv_sharing_target: str | None = None):
        self.kv_cache = [kv_cache]
        self.kv_sharing_target_layer_name = kv_sharing_target


@dataclass
class Load:
    """One new request's admission in one step, as the scheduler decided it:
    tokens [0, num_local_tokens) are a prefix-cache hit, the next
    num_external_tokens are loaded by the connector."""

    num_local_tokens: int
    num_external_tokens: int
    tables: tuple[list[int], ...]  # the request's block table of each group

    def slots(self, group: int) -> set[int]:
        """The slots of the external tokens in a group, null blocks left out:
        what the load may write into, and all it must write."""
        table = self.tables[group]
        end = self.num_local_tokens + self.num_external_tokens
        return {
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(self.num_local_tokens, end)
            if table[p // BLOCK_SIZE] != 0
        }


@dataclass
class Finished:
    """One request_finished_all_groups call and what it returned."""

    request_id: str
    block_ids: tuple[list[int], ...]
    result: Any


class Engine:
    """vLLM's engine loop with LMCache, for one model-like layout."""

    def __init__(self, layout: Layout, hma: bool, kernel, use_eagle: bool = False):
        self.layout = layout
        self.kernel = kernel
        self.vllm_config = layout_vllm_config(layout, hma, use_eagle)
        self.worker_config, self.scheduler_config = kv_cache_configs(
            layout, self.vllm_config
        )
        self.buffers = paged_buffers(self.worker_config)
        for buf in self.buffers.values():
            buf[:, 0] = NULL_BLOCK_SENTINEL
        kernel.register(list(self.buffers.values()))
        cuda_boundary.build_cpu_engine(self.vllm_config)
        self.worker = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, self.worker_config
        )
        self.scheduler = make_scheduler(self.vllm_config, self.scheduler_config)
        self.connector = self.scheduler.connector
        self.groups = self.scheduler_config.kv_cache_groups
        self.group_of_layer = {
            name: g
            for g, group in enumerate(self.worker_config.kv_cache_groups)
            for name in group.layer_names
        }
        # Layers that reuse another layer's KV cache are in the forward
        # context (with the target's tensor) but in no KV cache group; the
        # model's writes and reads go through their targets.
        layers = {n: _Layer(t) for n, t in self.buffers.items()}
        for name, target in layout.kv_sharing_targets().items():
            layers[name] = _Layer(self.buffers[target], target)
        self.forward_context = ForwardContext(
            no_compile_layers=dict(
                sorted(layers.items(), key=lambda kv: int(kv[0].split(".")[2]))
            ),
            attn_metadata={},
            virtual_engine=0,
        )
        # Called right after each step's wait_for_save (tests set it).
        self.after_save = None
        self.requests: dict[str, Request] = {}
        self.loads: dict[str, Load] = {}  # of the last step
        self.finished: list[Finished] = []
        self._lookups: dict[str, int] = {}  # request -> local hit at lookup
        self._spy_request_finished()

    # -- set-up ------------------------------------------------------------

    def _spy_request_finished(self) -> None:
        """Record what the scheduler asks the connector (instrumentation only:
        the connector's methods run unchanged)."""
        connector = self.connector
        lookup = connector.get_num_new_matched_tokens

        def lookup_spy(request, num_computed_tokens):
            result = lookup(request, num_computed_tokens)
            self._lookups[request.request_id] = num_computed_tokens
            return result

        connector.get_num_new_matched_tokens = lookup_spy
        original = connector.request_finished_all_groups

        def spy(request, block_ids):
            result = original(request, block_ids)
            self.finished.append(
                Finished(
                    request.request_id, tuple(list(ids) for ids in block_ids), result
                )
            )
            return result

        connector.request_finished_all_groups = spy

    def add(self, token_ids: list[int], max_tokens: int = 1) -> Request:
        request = make_request(f"r{len(self.requests)}", token_ids, BLOCK_SIZE)
        request.sampling_params.max_tokens = max_tokens
        request.max_tokens = max_tokens
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    # -- what the model runner and engine core do ---------------------------

    def tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of each KV cache group (vLLM's)."""
        return tuple(
            list(ids)
            for ids in self.scheduler.kv_cache_manager.get_block_ids(request_id)
        )

    @staticmethod
    def computed_before(so: SchedulerOutput) -> dict[str, int]:
        """Tokens each scheduled request had computed before this step (the
        scheduler advances ``num_computed_tokens`` when it schedules)."""
        out = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        out.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return out

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, load, forward, save, update."""
        so = self.scheduler.schedule()
        start = self.computed_before(so)
        self._record_loads(so)
        self.kernel.reset()
        self.worker.bind_connector_metadata(so.kv_connector_metadata)
        self.worker.start_load_kv(self.forward_context)
        self.check_reads(so)
        self.forward(so)
        self.worker.wait_for_save()
        if self.after_save is not None:
            self.after_save(so)
        self.worker.clear_connector_metadata()
        self.check_null_block()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests[req_id]
            done = start[req_id] + n >= request.num_tokens
            sampled[req_id] = [self.next_token(request)] if done else []
        ids = list(sampled)
        kv_output = None
        if sending or recving or invalid:
            kv_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=invalid,
            )
        self.scheduler.update_from_output(
            so,
            model_runner_output(
                ids,
                [sampled[r] for r in ids],
                kv_connector_output=kv_output,
            ),
        )
        return so

    def run(self, max_steps: int = 2000) -> None:
        """Steps until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests left after max_steps")

    @staticmethod
    def next_token(request: Request) -> int:
        return prefix_hashes(list(request.all_token_ids))[-1] % 30000 + 1000

    def _record_loads(self, so: SchedulerOutput) -> None:
        """The external tokens of each new request, from the scheduler's own
        accounting (local hit, then external tokens)."""
        self.loads = {}
        for new in so.scheduled_new_reqs:
            num_computed = new.num_computed_tokens
            num_local = self._lookups.get(new.req_id, num_computed)
            self.loads[new.req_id] = Load(
                num_local, num_computed - num_local, self.tables(new.req_id)
            )

    def forward(self, so: SchedulerOutput) -> None:
        """The model's part: the K and V of every scheduled token, in every
        layer, written into the token's slot of the layer's KV cache group."""
        computed_before = self.computed_before(so)
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = computed_before[req_id]
            hashes = prefix_hashes(list(request.all_token_ids)[: start + n])
            tables = self.tables(req_id)
            for layer, (name, buf) in enumerate(self.buffers.items()):
                table = tables[self.group_of_layer[name]]
                slots, values = [], []
                for p in range(start, start + n):
                    block = table[p // BLOCK_SIZE]
                    assert block != 0, (req_id, name, p, "computed into a null block")
                    slots.append(block * BLOCK_SIZE + p % BLOCK_SIZE)
                    values.append(kv_value(hashes[p], layer))
                flat = buf.view(2, -1, buf.shape[-2] * buf.shape[-1])
                v = torch.tensor(values, dtype=flat.dtype)[:, None]
                flat[0, slots] = v
                flat[1, slots] = -v

    def check_reads(self, so: SchedulerOutput) -> None:
        """Every token the first scheduled token of each request attends to
        (already computed or loaded) holds its K and V, in a real block."""
        for req_id, position in self.computed_before(so).items():
            request = self.requests[req_id]
            hashes = prefix_hashes(list(request.all_token_ids)[:position])
            tables = self.tables(req_id)
            for layer, (name, buf) in enumerate(self.buffers.items()):
                spec = spec_of_layer(self.worker_config, name)
                table = tables[self.group_of_layer[name]]
                flat = buf.view(2, -1, buf.shape[-2] * buf.shape[-1])
                first = first_read_position(spec, position)
                for p in range(first, position):
                    block = table[p // BLOCK_SIZE]
                    assert block != 0, (req_id, name, p, "reads a null block")
                    slot = block * BLOCK_SIZE + p % BLOCK_SIZE
                    want = kv_value(hashes[p], layer)
                    got_k, got_v = flat[0, slot], flat[1, slot]
                    assert bool((got_k == want).all() and (got_v == -want).all()), (
                        f"{req_id} layer {name} ({type(spec).__name__}) token {p}: "
                        f"K {got_k[0].item()} V {got_v[0].item()}, want {want}"
                    )

    def check_null_block(self) -> None:
        """No load and no forward wrote into vLLM's null block."""
        for name, buf in self.buffers.items():
            assert bool((buf[:, 0] == NULL_BLOCK_SENTINEL).all()), (
                f"the null block of {name} was written"
            )

    # -- what the tests look at ----------------------------------------------

    def stored_chunks(self, token_ids: list[int]) -> list[torch.Tensor | None]:
        """What LMCache holds for each full chunk of ``token_ids``: its memory
        object's tensor ``[2, num_layers, chunk_size, hidden]`` (None if
        missing)."""
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        lmcache_engine = LMCacheEngineBuilder.get(ENGINE_NAME)
        chunks = []
        for _, _, key in lmcache_engine.token_database.process_tokens(tokens=token_ids):
            memory_obj = lmcache_engine.storage_manager.get(key)
            chunks.append(None if memory_obj is None else memory_obj.tensor.clone())
            if memory_obj is not None:
                memory_obj.ref_count_down()
        return chunks

    def check_stored_prefix(self, token_ids: list[int]) -> None:
        """LMCache holds every full chunk of ``token_ids``, each layer's part
        with that layer's K and V of every token (for a prefix computed in
        steps where all its blocks were real). Another vLLM instance, or this
        one after a restart, reads them by layer: a mix-up of layers or groups
        that a store and a load of this instance would undo must show here."""
        chunks = self.stored_chunks(token_ids)
        assert chunks and all(c is not None for c in chunks), "chunks missing"
        for layer in range(len(self.buffers)):
            want = self.expected_kv(token_ids, layer)
            for i, chunk in enumerate(chunks):
                size = chunk.shape[2]
                w = want[i * size : (i + 1) * size, None]
                assert bool((chunk[0, layer] == w).all()), (layer, i, "K")
                assert bool((chunk[1, layer] == -w).all()), (layer, i, "V")

    def expected_kv(self, token_ids: list[int], layer: int) -> torch.Tensor:
        """K of each token of ``token_ids`` in ``layer`` (V is its negative)."""
        return torch.tensor(
            [kv_value(h, layer) for h in prefix_hashes(token_ids)],
            dtype=torch.float32,
        )

    def check_load_slots(self, req_id: str) -> None:
        """The last step's loads wrote exactly the slots of ``req_id``'s
        external tokens (in every layer's buffer: the slots of the groups with
        a layer on it), never a slot of the null block (block 0) or of the
        prefix-cache hit, and nothing for another token."""
        load = self.loads[req_id]
        written = self.kernel.written_slots()
        for ptr in {buf.data_ptr() for buf in self.buffers.values()}:
            groups = {
                self.group_of_layer[n]
                for n, b in self.buffers.items()
                if b.data_ptr() == ptr
            }
            expected = set().union(*(load.slots(g) for g in groups))
            got = written.get(ptr, set())
            layers = [n for n, b in self.buffers.items() if b.data_ptr() == ptr]
            assert not {s for s in got if s < BLOCK_SIZE}, (
                f"{req_id}: load wrote into the null block ({layers})"
            )
            local = {
                t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for g in groups
                for t in [load.tables[g]]
                for p in range(load.num_local_tokens)
                if t[p // BLOCK_SIZE] != 0
            }
            assert not got & local, (
                f"{req_id}: load wrote {len(got & local)} slots of the prefix-cache "
                f"hit ({load.num_local_tokens} tokens) ({layers})"
            )
            assert got == expected, (
                f"{req_id}: load wrote {len(got - expected)} slots outside and "
                f"missed {len(expected - got)} of the {len(expected)} slots of its "
                f"{load.num_external_tokens} external tokens ({layers})"
            )

    def evict_lmcache_chunks(self, token_ids: list[int], chunks: list[int]) -> None:
        """LMCache evicts some chunks (by index) of ``token_ids``."""
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        lmcache_engine = LMCacheEngineBuilder.get(ENGINE_NAME)
        keys = [
            key
            for _, _, key in lmcache_engine.token_database.process_tokens(
                tokens=token_ids
            )
        ]
        for i in chunks:
            assert lmcache_engine.storage_manager.remove(keys[i])

    def clear_lmcache(self) -> None:
        """Everything LMCache stored is gone (as after its eviction)."""
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.get(ENGINE_NAME).clear()

    def shutdown(self) -> None:
        """Destroy the LMCache engine (not the adapters' shutdown(): in one
        process the scheduler's lookup client would terminate the process-wide
        ZMQ context under the worker's sockets)."""
        cuda_boundary.destroy_engine()
