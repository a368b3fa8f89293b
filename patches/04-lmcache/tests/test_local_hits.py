"""Kind 2: LMCache chunks overlapping vLLM's prefix-cache hits and null blocks.

LMCache moves whole chunks (256 tokens here). vLLM's prefix-cache hit is a
multiple of the block size (16), so an LMCache load starts inside the hit: the
load must write only the external tokens the scheduler allocated for it,
never the hit's blocks (shared with other requests) and never the null block
(which sliding-window groups put before their window). The same overlap on
the store side: a request whose prefix-cache hit holds null blocks must not
store zeros for tokens a later LMCache hit will read.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine

PROMPT = list(range(1000, 2100))  # 1100 tokens; LMCache stores [0, 1024)


def seed_lmcache(engine: Engine) -> None:
    """A computes PROMPT; LMCache stores its first four chunks. vLLM's prefix
    cache is reset afterwards."""
    engine.add(PROMPT)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()


@pytest.mark.parametrize(
    "layout",
    [layouts.gpt_oss_like(), layouts.gemma3_like(), layouts.llama4_like()],
    ids=lambda lay: lay.name,
)
@pytest.mark.parametrize("local_tokens", [304, 512, 784])
def test_load_never_writes_the_prefix_cache_hit(make_engine, layout, local_tokens):
    """A request with a prefix-cache hit of ``local_tokens`` (not a multiple of
    LMCache's chunk except 512) and an LMCache hit of 1024 loads exactly
    tokens [local_tokens, 1024)."""
    engine = make_engine(layout, hma=True)
    seed_lmcache(engine)
    # C leaves blocks of PROMPT[:local_tokens] in vLLM's prefix cache.
    engine.add(PROMPT[: local_tokens + 5])
    engine.run()
    b = engine.add(PROMPT[:1024] + list(range(7000, 7040)))
    engine.step()
    load = engine.loads[b.request_id]
    assert load.num_local_tokens == local_tokens
    assert load.num_local_tokens + load.num_external_tokens == 1024
    engine.check_load_slots(b.request_id)
    engine.run()


def test_load_of_a_whole_prompt_leaves_the_recomputed_token(make_engine):
    """The prompt is all in LMCache: vLLM recomputes its last token, so the
    load must not write that token's slot (it is not an external token)."""
    engine = make_engine(layouts.gpt_oss_like(), hma=True)
    seed_lmcache(engine)
    b = engine.add(PROMPT[:1024])
    engine.step()
    load = engine.loads[b.request_id]
    assert (load.num_local_tokens, load.num_external_tokens) == (0, 1023)
    engine.check_load_slots(b.request_id)


@pytest.mark.parametrize(
    "layout",
    [layouts.gpt_oss_like(), layouts.gemma3_like(), layouts.llama4_like()],
    ids=lambda lay: lay.name,
)
def test_store_with_prefix_cache_hit_never_stores_null_blocks(make_engine, layout):
    """LMCache lost PROMPT (evicted) while vLLM's prefix cache still holds it:
    B gets a 1088-token prefix-cache hit whose sliding-window (or chunked
    local) part is mostly null blocks. B must not store those tokens as
    LMCache chunks (LMCache 0.3.11 counts the hit, rounded down to its chunk
    size, as already stored and skips it): C, which later looks up a shorter
    prefix, finds nothing in LMCache and computes it, instead of loading
    chunks whose window tokens were never stored."""
    engine = make_engine(layout, hma=True)
    engine.add(PROMPT)
    engine.run()
    engine.clear_lmcache()
    b = engine.add(PROMPT + [7, 8, 9])
    engine.step()
    assert engine.loads[b.request_id].num_local_tokens == 1088
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    c = engine.add(PROMPT[:300] + list(range(7000, 7040)))
    engine.step()  # checks every token C's attention reads
    assert engine.loads[c.request_id].num_external_tokens == 0
    engine.run()


@pytest.mark.parametrize(
    "layout",
    [layouts.gpt_oss_like(), layouts.gemma3_like(), layouts.llama4_like()],
    ids=lambda lay: lay.name,
)
def test_store_under_a_hit_limit_never_stores_null_blocks(
    make_engine, layout, monkeypatch
):
    """LMCache's hit limit (``hit_miss_ratio``, HitLimitLookupClient) reports
    less than vLLM's prefix-cache hit; so do lookup clients that ignore the
    hit (LMCacheAsyncLookupClient, MooncakeLookupClient: not run here). B then
    stores chunks inside its prefix-cache hit, whose sliding-window (or
    chunked local) blocks are null: those chunks must not be stored, or C,
    which loads them later, reads zeros."""
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config

    monkeypatch.setattr(lmcache_get_or_create_config(), "hit_miss_ratio", 0.5)
    engine = make_engine(layout, hma=True)
    engine.add(PROMPT)
    engine.run()  # LMCache holds chunks 0..3
    engine.evict_lmcache_chunks(PROMPT[:1024], [2, 3])
    b = engine.add(PROMPT + [7, 8, 9])
    engine.step()
    # vLLM's hit: 1088 tokens; LMCache's (limited to half of 1103 tokens): 512.
    assert engine.loads[b.request_id].num_local_tokens == 1088
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    # C's hit is limited to 768 of its 1924 tokens: chunk 2, if B stored it,
    # is loaded and its window tokens read.
    c = engine.add(PROMPT[:1024] + list(range(7000, 7900)))
    engine.step()  # checks every token C's attention reads
    engine.check_load_slots(c.request_id)
    engine.run()
