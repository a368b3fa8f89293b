"""Model-like KV cache layouts, grouped by vLLM's own code.

Each layout lists the KV cache spec of every layer, as vLLM's attention and
Mamba layers report them (``get_kv_cache_spec``), and turns them into the
worker's and the scheduler's ``KVCacheConfig`` with vLLM 0.13.0's
``get_kv_cache_configs`` and ``generate_scheduler_kv_cache_config`` (what
``EngineCore._initialize_kv_caches`` calls): the KV cache groups, their order
and the shared KV cache tensors are vLLM's, with HMA on or off.

The model config (a hub config in ``build/hf-home``, no weights) gives LMCache
its shapes (layers, KV heads, head size); the layer specs must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hmastack_testkit.kv_layouts import make_cpu_vllm_config, make_spec
from vllm.config import KVTransferConfig, SpeculativeConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

BLOCK_SIZE = 16
CHUNK = 256  # LMCache's chunk size (LMCACHE_CHUNK_SIZE, set by conftest.py)
NUM_BLOCKS = 768
MAX_MODEL_LEN = 2048
DTYPE = torch.float32

GEMMA3 = "hmastack/gemma3-like-text"  # 12 layers, 1 KV head of 64
GPT_OSS = "hmastack/gpt-oss-like"  # 4 layers, 2 KV heads of 64
LLAMA = "hmellor/tiny-random-LlamaForCausalLM"  # 2 layers, 4 KV heads of 4

# Layer kind -> the attention kind of ``hmastack_testkit.kv_layouts.make_spec``.
SPEC_KINDS = {"full": "full", "sliding": "sliding_window", "chunked": "chunked_local"}


@dataclass(frozen=True)
class Layer:
    """One layer: ``kind`` "full", "sliding", "chunked", "mamba" or "shared";
    ``window`` the sliding window or attention chunk size in tokens; KV heads
    and head size (None: the model config's); for "shared", ``target`` is the
    index of the layer whose KV cache it reuses (vLLM's
    ``kv_sharing_target_layer_name``: no KV cache spec of its own)."""

    kind: str
    window: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    target: int | None = None


@dataclass(frozen=True)
class Layout:
    name: str
    model: str
    layers: tuple[Layer, ...]

    def layer_name(self, i: int) -> str:
        return f"model.layers.{i}.self_attn.attn"

    def kv_sharing_targets(self) -> dict[str, str]:
        """Sharing layer -> the layer whose KV cache it reuses (names)."""
        return {
            self.layer_name(i): self.layer_name(layer.target)
            for i, layer in enumerate(self.layers)
            if layer.kind == "shared" and layer.target is not None
        }


def _pattern(kinds: str, window: int | None) -> tuple[Layer, ...]:
    names = {"F": "full", "S": "sliding", "C": "chunked", "M": "mamba"}
    return tuple(
        Layer(names[k], window if k in "SC" else None) for k in kinds.replace(" ", "")
    )


def gemma3_like(window: int = 512) -> Layout:
    """Gemma 3: five sliding-window layers per full-attention layer. With HMA,
    vLLM makes five sliding-window groups of two layers and one full-attention
    group, the last one."""
    return Layout(f"gemma3-like(W={window})", GEMMA3, _pattern("SSSSSF" * 2, window))


def gpt_oss_like(window: int = 128) -> Layout:
    """gpt-oss: sliding-window (first) and full-attention layers alternate."""
    return Layout(f"gpt-oss-like(W={window})", GPT_OSS, _pattern("SF" * 2, window))


def llama4_like(chunk: int = 384) -> Layout:
    """Llama 4: three chunked-local-attention layers per full-attention
    (NoPE) layer; vLLM makes three chunked local groups and one full one."""
    return Layout(f"llama4-like(A={chunk})", GEMMA3, _pattern("CCCF" * 3, chunk))


def gemma3n_like(window: int = 512) -> Layout:
    """Gemma-3n: the last layers reuse the KV cache of earlier layers of the
    same attention type (``kv_sharing_target_layer_name``); vLLM gives them no
    KV cache spec, so they are in no KV cache group of the configuration the
    connector gets. Here layers 10 (sliding) and 11 (full) reuse layers 4 and
    5."""
    layers = list(_pattern("SSSSSF" * 2, window))
    layers[10] = Layer("shared", target=4)
    layers[11] = Layer("shared", target=5)
    return Layout(f"gemma3n-like(W={window})", GEMMA3, tuple(layers))


def full_attention_only() -> Layout:
    return Layout("llama-tiny", LLAMA, _pattern("FF", None))


def uniform_type_storable() -> Layout:
    """Full attention only, with layers of 2 KV heads of 64 and 1 KV head of
    128: one attention type, different shapes, so vLLM puts all layers in one
    group with a ``UniformTypeKVCacheSpecs`` spec (HMA on and off). Every layer
    has 128 K (and V) values per token, as LMCache's chunks hold them."""
    return Layout(
        "uniform-type(2x64|1x128)",
        GPT_OSS,
        tuple(Layer("full", None, h, s) for h, s in ((2, 64), (1, 128)) * 2),
    )


def uniform_type_mixed_hidden() -> Layout:
    """Full attention with 2 and 1 KV heads of 64 (per-layer KV heads, as in
    OpenELM or Nemotron-NAS): a ``UniformTypeKVCacheSpecs`` group whose layers
    have 128 and 64 values per token."""
    return Layout(
        "uniform-type(2x64|1x64)",
        GPT_OSS,
        tuple(Layer("full", None, h, 64) for h in (2, 1) * 2),
    )


def mamba_hybrid() -> Layout:
    """Three Mamba layers per full-attention layer (Jamba, Granite 4.0-H)."""
    return Layout("mamba-hybrid", GEMMA3, _pattern("MMMF" * 3, None))


def layout_vllm_config(
    layout: Layout, hma: bool, use_eagle: bool = False
) -> VllmConfig:
    """The CPU VllmConfig of a layout, with LMCacheConnectorV1 and prefix
    caching. HMA is set after VllmConfig's own decision (which turns it off on
    CPU, and with connectors on vLLM 0.13.0). With ``use_eagle``, speculative
    decoding by eagle as the scheduler sees it (``use_eagle()``): vLLM's CPU
    model runner refuses a speculative config, and no drafter runs here."""
    config = make_cpu_vllm_config(
        BLOCK_SIZE,
        NUM_BLOCKS,
        KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        model=layout.model,
        dtype="float32",
        num_gpu_blocks_override=NUM_BLOCKS,
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    if use_eagle:
        speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
        object.__setattr__(speculative_config, "method", "eagle")
        config.speculative_config = speculative_config
    return config


def layer_specs(layout: Layout, vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """What each layer's ``get_kv_cache_spec`` reports."""
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    specs: dict[str, KVCacheSpec] = {}
    attention_page = None
    for i, layer in enumerate(layout.layers):
        if layer.kind in ("mamba", "shared"):
            continue
        spec = make_spec(
            SPEC_KINDS[layer.kind],
            BLOCK_SIZE,
            layer.window,
            num_kv_heads=layer.num_kv_heads or num_kv_heads,
            head_size=layer.head_size or head_size,
            dtype=DTYPE,
        )
        specs[layout.layer_name(i)] = spec
        attention_page = spec.page_size_bytes
    for i, layer in enumerate(layout.layers):
        if layer.kind == "mamba":
            # vLLM pads a Mamba layer's page to the attention page size.
            specs[layout.layer_name(i)] = MambaSpec(
                block_size=BLOCK_SIZE,
                shapes=((4, 64), (1, 8, 32)),
                dtypes=(DTYPE, DTYPE),
                page_size_padded=attention_page,
            )
    return dict(sorted(specs.items(), key=lambda kv: _layer_index(kv[0])))


def _layer_index(name: str) -> int:
    return int(name.split(".")[2])


def kv_cache_configs(
    layout: Layout, vllm_config: VllmConfig
) -> tuple[KVCacheConfig, KVCacheConfig]:
    """(worker config, scheduler config), from vLLM's own grouping code."""
    specs = layer_specs(layout, vllm_config)
    page = max(s.page_size_bytes for s in specs.values())
    (worker,) = get_kv_cache_configs(
        vllm_config, [specs], [page * len(specs) * NUM_BLOCKS * 4]
    )
    assert worker.num_blocks == NUM_BLOCKS
    return worker, generate_scheduler_kv_cache_config([worker])


def spec_of_layer(kv_cache_config: KVCacheConfig, layer_name: str) -> KVCacheSpec:
    for group in kv_cache_config.kv_cache_groups:
        if layer_name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                return spec.kv_cache_specs[layer_name]
            return spec
    raise KeyError(layer_name)


def paged_buffers(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Each attention layer's paged KV cache, as vLLM's GPU model runner views
    the shared KV cache tensors: ``[2, num_blocks, block_size, num_kv_heads,
    head_size]``; layers in one ``KVCacheTensor`` share its memory (one layer
    per KV cache group; their block ids are disjoint)."""
    out: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        for name in tensor.shared_by:
            spec = spec_of_layer(kv_cache_config, name)
            out[name] = raw.view(spec.dtype).view(
                2,
                kv_cache_config.num_blocks,
                spec.block_size,
                spec.num_kv_heads,
                spec.head_size,
            )
    return dict(sorted(out.items(), key=lambda kv: _layer_index(kv[0])))
