"""What LMCache's adapter claims, it loads: into every real block the
scheduler allocates for its external tokens, with eagle on and off.

With eagle, a new request with external tokens gets sliding-window tables
that start at the window of the last block boundary before its computed
tokens (vLLM's ``BlockTableLayout``): one block more than the window of the
first token it computes (two on vLLM 0.13.0's lookup with full attention and
sliding window groups). The adapter claims LMCache's hit beyond vLLM's local
prefix cache hit and loads every one of those tokens into the real blocks of
every group: the extra block included, the null blocks left out. A request
with a local hit loads only after it. Chunked local attention with eagle runs
with the hybrid KV cache manager off (VllmConfig), so only the window layouts
run with eagle here.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine
from layouts import BLOCK_SIZE

PROMPT = list(range(3000, 3600))


def eagle_layouts():
    return [layouts.gpt_oss_like(w) for w in (48, 40)] + [layouts.gemma3_like(64)]


def check_load_covers_the_real_blocks(engine: Engine, request_id: str) -> None:
    """The load wrote exactly the external tokens' slots of the real blocks
    (``Engine.check_load_slots``), and those are the blocks the scheduler's
    rule allocates for them (``BlockTableLayout``, where the tree has it)."""
    engine.check_load_slots(request_id)
    load = engine.loads[request_id]
    layout = getattr(engine.scheduler.kv_cache_manager, "block_table_layout", None)
    if layout is None:
        return
    request = engine.requests[request_id]
    ranges = layout.get_external_block_ranges(
        request.num_tokens, load.num_local_tokens, load.num_external_tokens
    )
    for g, block_range in enumerate(ranges):
        real = {s // BLOCK_SIZE for s in load.slots(g)}
        table = load.tables[g]
        assert real == {table[i] for i in block_range}, (g, block_range)


@pytest.mark.parametrize("whole_prompt", [False, True], ids=["hit", "whole-prompt"])
@pytest.mark.parametrize("use_eagle", [False, True], ids=["no-eagle", "eagle"])
@pytest.mark.parametrize("layout", eagle_layouts(), ids=lambda lay: lay.name)
def test_load_fills_every_real_block(make_engine, layout, use_eagle, whole_prompt):
    """A 600-token prompt is stored, vLLM's prefix cache reset; the same
    512-token prefix (plus 3 tokens, or alone: LMCache holds the whole
    prompt and vLLM computes its last token) is loaded by LMCache into every
    real block of every group, and every token the request reads holds its
    KV (``Engine.step`` checks the reads), with eagle as without."""
    engine: Engine = make_engine(layout, hma=True, use_eagle=use_eagle)
    assert engine.scheduler.use_eagle == use_eagle
    engine.add(PROMPT)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(PROMPT[:512] if whole_prompt else PROMPT[:512] + [1, 2, 3])
    engine.step()
    load = engine.loads[b.request_id]
    assert load.num_local_tokens == 0
    assert load.num_external_tokens == (511 if whole_prompt else 512)
    check_load_covers_the_real_blocks(engine, b.request_id)
    engine.run()


@pytest.mark.parametrize("num_local_tokens", [260, 330])
@pytest.mark.parametrize("use_eagle", [False, True], ids=["no-eagle", "eagle"])
@pytest.mark.parametrize("layout", eagle_layouts(), ids=lambda lay: lay.name)
def test_load_after_a_local_hit(make_engine, layout, use_eagle, num_local_tokens):
    """vLLM holds a shorter prefix of the prompt in its prefix cache (its
    sliding-window groups only the window of the hit): the request hits it
    locally and LMCache loads the rest of its 512 tokens, into every real
    block after the hit and none of the hit's."""
    engine: Engine = make_engine(layout, hma=True, use_eagle=use_eagle)
    engine.add(PROMPT)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add(PROMPT[:num_local_tokens] + [9])
    engine.run()
    b = engine.add(PROMPT[:512] + [1, 2, 3])
    engine.step()
    load = engine.loads[b.request_id]
    assert load.num_local_tokens > 0
    assert load.num_local_tokens + load.num_external_tokens == 512
    check_load_covers_the_real_blocks(engine, b.request_id)
    engine.run()


@pytest.mark.parametrize("use_eagle", [False, True], ids=["no-eagle", "eagle"])
def test_adapter_skips_tokens_by_vllm_rule(make_engine, use_eagle):
    """The adapter's scheduler side counts the tokens vLLM skips of a running
    request (the blocks its tracker drops as null) as the scheduler's KV cache
    manager skips them (``BlockTableLayout.get_num_skipped_tokens``), in every
    group, with eagle on and off."""
    engine: Engine = make_engine(layouts.gemma3_like(64), hma=True, use_eagle=use_eagle)
    layout = engine.scheduler.kv_cache_manager.block_table_layout
    groups = engine.connector._lmcache_engine._kv_cache_groups
    assert len(groups) == len(engine.groups)
    assert any(layout.get_num_skipped_tokens(g, 4096) for g in range(len(groups)))
    for g, group in enumerate(groups):
        for n in (0, 62, 63, 64, 100, 511, 4096):
            assert group.get_num_skipped_tokens(n) == layout.get_num_skipped_tokens(
                g, n
            ), (g, n)
