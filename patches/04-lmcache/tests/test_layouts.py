"""Kind 1: the KV cache layouts vLLM 0.13.0 really produces.

vLLM groups a Gemma-3-like model into five sliding-window groups and one
full-attention group (the last), a gpt-oss-like one into a sliding-window and
a full-attention group, a Llama-4-like one into three chunked-local groups and
a full one, and puts layers of one attention type but different shapes into
one ``UniformTypeKVCacheSpecs`` group; with HMA off, everything but Mamba and
uniform-type groups becomes one full-attention group. The adapter must find
each layer's block table by its group's spec and layer names, never by
position.

Each test: request A computes and stores a prompt; vLLM's prefix cache is
reset; request B shares A's first 1024 tokens and loads them from LMCache.
The harness checks every token B's attention reads (by the layer's type);
the test checks that the load wrote exactly the external tokens' blocks.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine
from layouts import BLOCK_SIZE

PREFIX = list(range(1000, 2024))  # 1024 tokens: four LMCache chunks


def shared_prefix_hit(engine: Engine, suffix_len: int = 76):
    """A computes PREFIX + its own suffix (stored in LMCache); after a reset of
    vLLM's prefix cache, B with the same prefix is admitted with an external
    hit and computes its suffix."""
    a = engine.add(PREFIX + list(range(5000, 5000 + suffix_len)))
    engine.run()
    engine.check_stored_prefix(PREFIX)
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(PREFIX + list(range(9000, 9000 + suffix_len)))
    engine.step()  # loads, checks B's reads, computes B's suffix
    return a, b


LAYOUTS = [
    layouts.gemma3_like(),
    layouts.gpt_oss_like(),
    layouts.llama4_like(),
    layouts.uniform_type_storable(),
    layouts.full_attention_only(),
]


@pytest.mark.parametrize("hma", [True, False], ids=["hma", "hma-off"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_external_hit_on_real_layout(make_engine, layout, hma):
    engine = make_engine(layout, hma)
    _, b = shared_prefix_hit(engine)
    load = engine.loads[b.request_id]
    assert (load.num_local_tokens, load.num_external_tokens) == (0, 1024)
    engine.check_load_slots(b.request_id)
    # The blocks a group keeps for the hit are decided by its spec: with HMA,
    # a sliding window (W) keeps the blocks of tokens from 1024 - W + 1 on, a
    # chunked local group those of the current attention chunk.
    for g, group in enumerate(engine.groups):
        real = {s // BLOCK_SIZE for s in load.slots(g)}
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        chunk = getattr(spec, "attention_chunk_size", None)
        if hma and type(spec).__name__ == "SlidingWindowSpec":
            assert len(real) == 64 - (1024 - window + 1) // BLOCK_SIZE
        elif hma and type(spec).__name__ == "ChunkedLocalAttentionSpec":
            assert len(real) == 64 - 1024 // chunk * chunk // BLOCK_SIZE
        else:
            assert len(real) == 64
    engine.run()


def test_gemma3_like_groups_full_attention_last(make_engine):
    """The layout the other tests rely on: vLLM puts the full-attention group
    last for a model whose first layer is a sliding-window layer."""
    engine = make_engine(layouts.gemma3_like(), True)
    kinds = [type(g.kv_cache_spec).__name__ for g in engine.groups]
    assert kinds == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
    assert engine.groups[5].layer_names == [
        "model.layers.5.self_attn.attn",
        "model.layers.11.self_attn.attn",
    ]


@pytest.mark.parametrize("hma", [True, False], ids=["hma", "hma-off"])
def test_full_attention_only_model_copies_as_before(make_engine, hma):
    """One KV cache group: one kernel call per chunk with all layers and the
    1-D slot mapping, on store and on load, as LMCache 0.3.11 copies."""
    engine = make_engine(layouts.full_attention_only(), hma)
    assert len(engine.groups) == 1
    a = engine.add(list(range(1000, 1600)))
    engine.step()
    assert engine.kernel.calls == 2  # chunks 0..255 and 256..511
    assert [len(c.slots) for c in engine.kernel.copies] == [256] * 4
    assert all(c.to_lmcache for c in engine.kernel.copies)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(list(a.all_token_ids[:512]) + [1, 2, 3])
    engine.step()
    assert engine.kernel.calls == 2
    assert [len(c.slots) for c in engine.kernel.copies] == [256] * 4
    engine.check_load_slots(b.request_id)
    engine.run()
