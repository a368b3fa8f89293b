"""A vLLM engine step loop around LMCache's adapter, without a model.

`Pair` holds vLLM's `LMCacheConnectorV1` in both roles over one LMCache engine,
paged KV buffers on CPU (one per layer) and the block tables that vLLM's KV
cache manager would hold with stage 03. Each `step` builds a `SchedulerOutput`,
hands the metadata from the scheduler-side connector to the worker-side one,
runs `start_load_kv` and `wait_for_save` (what vLLM's model runner does around
the forward pass), then advances the requests like vLLM's scheduler.

Works against LMCache 0.3.11 too (HMA off, one group): `before_after.py`.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

BLOCK_SIZE = 16
NUM_BLOCKS = 2048
MODELS = {
    "gemma3-like": "hmastack/gemma3-like-text",  # 5 sliding (W=512) : 1 full
    "gpt-oss-like": "hmastack/gpt-oss-like",  # 1 sliding (W=128) : 1 full
    "llama-tiny": "hmellor/tiny-random-LlamaForCausalLM",  # full attention only
}
_ids = itertools.count()


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_vllm_config(model: str, hma: bool) -> VllmConfig:
    config = VllmConfig(
        model_config=ModelConfig(
            model=MODELS[model], dtype="bfloat16", skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_model_len=4096, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both"
        ),
    )
    # vLLM 0.13 decides HMA in VllmConfig.__post_init__, and turns it off on
    # CPU and for connectors; stage 03 keeps it on for SupportsHMA connectors.
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    return config


def make_kv_cache_config(vllm_config: VllmConfig) -> KVCacheConfig:
    """The KV cache groups vLLM forms for the model (real grouping code)."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    layer_types = getattr(hf, "layer_types", None) or (
        ["full_attention"] * hf.num_hidden_layers
    )
    specs = {}
    for i, kind in enumerate(layer_types):
        common = dict(
            block_size=BLOCK_SIZE,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=torch.bfloat16,
        )
        if kind == "sliding_attention":
            specs[layer_name(i)] = SlidingWindowSpec(
                **common, sliding_window=hf.sliding_window
            )
        else:
            specs[layer_name(i)] = FullAttentionSpec(**common)
    groups = get_kv_cache_groups(vllm_config, specs)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )


def skipped_blocks(spec, num_computed_tokens: int) -> int:
    """vLLM's rule (stage 01): blocks that only hold skipped tokens."""
    window = getattr(spec, "sliding_window", None)
    if not isinstance(spec, SlidingWindowSpec) or window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // spec.block_size


class _Layer:
    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = [kv_cache]


@dataclass
class Tracked:
    request: Request
    # What vLLM's KV cache manager holds, per group (0 = null block).
    block_tables: list[list[int]]
    new: bool = True
    num_new_blocks: list[list[int]] = field(default_factory=list)


class Pair:
    """vLLM's LMCacheConnectorV1, scheduler and worker, over one engine."""

    def __init__(self, model: str, hma: bool):
        from lmcache.integration.vllm.utils import (
            ENGINE_NAME,
            create_lmcache_metadata,
            lmcache_get_or_create_config,
        )
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
            LMCacheConnectorV1,
        )

        self.vllm_config = make_vllm_config(model, hma)
        self.kv_cache_config = make_kv_cache_config(self.vllm_config)
        self.specs = [g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups]
        hf = self.vllm_config.model_config.hf_text_config
        self.num_layers = hf.num_hidden_layers
        self.group_of_layer = {
            name: g
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }

        # The engine, as _init_lmcache_engine builds it, but on CPU.
        LMCacheEngineBuilder.destroy(ENGINE_NAME)
        metadata, config = create_lmcache_metadata(self.vllm_config, role="worker")
        assert config is lmcache_get_or_create_config()
        gpu_connector = VLLMPagedMemGPUConnectorV2.from_metadata(
            metadata, use_gpu=False, device=torch.device("cpu")
        )
        LMCacheEngineBuilder.get_or_create(
            ENGINE_NAME,
            config,
            metadata,
            gpu_connector,
            lambda tensor, src: tensor,
            lambda obj, src: obj,
        )
        self.worker = LMCacheConnectorV1(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.scheduler = LMCacheConnectorV1(
            self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )

        gen = torch.Generator().manual_seed(0)
        model_config = self.vllm_config.model_config
        shape = (
            2,
            NUM_BLOCKS,
            BLOCK_SIZE,
            model_config.get_num_kv_heads(self.vllm_config.parallel_config),
            model_config.get_head_size(),
        )
        self.kv_caches = {
            layer_name(i): torch.randn(shape, generator=gen).to(torch.bfloat16)
            for i in range(self.num_layers)
        }
        self.forward_context = ForwardContext(
            no_compile_layers={n: _Layer(t) for n, t in self.kv_caches.items()},
            attn_metadata={},
            virtual_engine=0,
        )
        self.next_block = itertools.count(1)
        self.running: dict[str, Tracked] = {}

    # -- what vLLM's scheduler and KV cache manager do -----------------------

    def add_request(self, prompt: list[int], max_tokens: int = 1024) -> Request:
        request = Request(
            request_id=f"req-{next(_ids)}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            eos_token_id=None,
        )
        return request

    def schedule_new(self, request: Request, num_new_tokens: int | None = None) -> int:
        """Admit a request: external hit, allocation (stage 03), one step.

        Returns the number of external tokens the connector will load."""
        num_external, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        num_external = num_external or 0
        num_computed = num_external
        if num_new_tokens is None:
            num_new_tokens = request.num_tokens - num_computed
        num_blocks = cdiv(num_computed + num_new_tokens, BLOCK_SIZE)
        tables = []
        for spec in self.specs:
            skipped = skipped_blocks(spec, num_computed)
            tables.append(
                [0] * skipped
                + [next(self.next_block) for _ in range(num_blocks - skipped)]
            )
        tracked = Tracked(request, tables)
        self.scheduler.update_state_after_alloc(request, None, num_external)
        request.num_computed_tokens = num_computed
        self.running[request.request_id] = tracked
        self._new_tokens = {request.request_id: num_new_tokens}
        return num_external

    def step(self, num_new_tokens: dict[str, int]) -> None:
        """One engine step for the running requests given."""
        new_reqs, cached = (
            [],
            dict(
                req_ids=[],
                new_block_ids=[],
                num_computed_tokens=[],
                num_output_tokens=[],
            ),
        )
        for req_id, n in num_new_tokens.items():
            t = self.running[req_id]
            req = t.request
            if t.new:
                new_reqs.append(
                    NewRequestData.from_request(
                        req, tuple(list(b) for b in t.block_tables)
                    )
                )
                continue
            # vLLM's allocate_slots: remove skipped blocks, then grow.
            for spec, table in zip(self.specs, t.block_tables, strict=False):
                k = min(skipped_blocks(spec, req.num_computed_tokens), len(table))
                table[:k] = [0] * k
            need = cdiv(req.num_computed_tokens + n, BLOCK_SIZE)
            new_ids = []
            for table in t.block_tables:
                grow = [next(self.next_block) for _ in range(need - len(table))]
                table.extend(grow)
                new_ids.append(grow)
            cached["req_ids"].append(req_id)
            cached["new_block_ids"].append(tuple(new_ids) if any(new_ids) else None)
            cached["num_computed_tokens"].append(req.num_computed_tokens)
            cached["num_output_tokens"].append(req.num_output_tokens)
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached["req_ids"]],
                all_token_ids={},
                **cached,
            ),
            num_scheduled_tokens=dict(num_new_tokens),
            total_num_scheduled_tokens=sum(num_new_tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0] * len(self.specs),
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        meta = self.scheduler.build_connector_meta(so)
        self.last_meta = meta
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self.forward_context)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        # vLLM's _update_after_schedule and update_from_output.
        for req_id, n in num_new_tokens.items():
            t = self.running[req_id]
            t.new = False
            t.request.num_computed_tokens += n
            if t.request.num_computed_tokens >= t.request.num_tokens:
                t.request.append_output_token_ids(7)

    def finish(self, request: Request) -> tuple:
        t = self.running.pop(request.request_id)
        if hasattr(self.scheduler, "request_finished_all_groups"):
            return self.scheduler.request_finished_all_groups(
                request, tuple(t.block_tables)
            )
        return self.scheduler.request_finished(request, t.block_tables[0])

    # -- what the tests look at ---------------------------------------------

    def layer_names(self) -> list[str]:
        return list(self.kv_caches)

    def kv(self, req_id: str, layer: str, start: int, end: int) -> torch.Tensor:
        """K and V of tokens [start, end) of a layer, null blocks left out."""
        slots = torch.tensor(self.slots(req_id, layer, start, end), dtype=torch.long)
        return self.kv_caches[layer].view(2, NUM_BLOCKS * BLOCK_SIZE, -1)[:, slots]

    def slots(self, req_id: str, layer: str, start: int, end: int) -> list[int]:
        """Slots of tokens [start, end) of a layer, leaving out null blocks."""
        table = self.running[req_id].block_tables[self.group_of_layer[layer]]
        return [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(start, end)
            if table[p // BLOCK_SIZE] != 0
        ]

    def shutdown(self) -> None:
        """Destroy the engine: its storage manager runs a non-daemon thread.

        Not the adapters' shutdown(): in one process, the scheduler's lookup
        client terminates the process-wide ZMQ context under the worker's
        sockets (in vLLM they live in different processes).
        """
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(ENGINE_NAME)


def adapter_takes_kv_cache_config() -> bool:
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    return "kv_cache_config" in inspect.signature(LMCacheConnectorV1Impl).parameters
