"""Kind 3: window-sized bounds, around every alignment.

A sliding-window group (window W, blocks of B tokens) keeps, for a request
with n computed tokens, the blocks from token max(0, n - W + 1) on: when that
token is not at a block start the window spans ceil((W - 1) / B) + 1 blocks,
one more than W / B. A chunked local group keeps the blocks of the current
attention chunk. Whatever the adapter derives from the window (the null
blocks of a running request's tracker, slot mappings, what a store covers)
must agree with vLLM's block tables at every alignment of the window start.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine
from hmastack_testkit.window import window_min_blocks
from layouts import BLOCK_SIZE, CHUNK


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# W % B = 0, 1, B - 1 and B / 2: the window's first token at every offset in
# its block, for hits that end on a block boundary (LMCache's chunks) and one
# token before it (a whole-prompt hit, whose last token vLLM recomputes).
WINDOWS = [48, 49, 47, 40]
CHUNKS = [384, 392]


def window_layouts():
    return [layouts.gpt_oss_like(w) for w in WINDOWS] + [
        layouts.llama4_like(a) for a in CHUNKS
    ]


def max_real_blocks(spec, num_computed_tokens: int) -> int:
    """The blocks a group keeps for ``num_computed_tokens`` tokens (the next
    token's window or attention chunk), by vLLM's rule."""
    n = num_computed_tokens
    window = getattr(spec, "sliding_window", None)
    if window is not None:
        return cdiv(n, BLOCK_SIZE) - max(0, n - window + 1) // BLOCK_SIZE
    chunk = spec.attention_chunk_size
    return cdiv(n, BLOCK_SIZE) - n // chunk * chunk // BLOCK_SIZE


@pytest.mark.parametrize("whole_prompt", [False, True], ids=["hit", "whole-prompt"])
@pytest.mark.parametrize("layout", window_layouts(), ids=lambda lay: lay.name)
def test_load_spans_exactly_the_window(make_engine, layout, whole_prompt):
    engine: Engine = make_engine(layout, hma=True)
    prompt = list(range(3000, 3600))
    engine.add(prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(prompt[:512] if whole_prompt else prompt[:512] + [1, 2, 3])
    engine.step()  # checks every token B's attention reads
    load = engine.loads[b.request_id]
    n = load.num_external_tokens
    assert n == (511 if whole_prompt else 512)
    engine.check_load_slots(b.request_id)
    for g, group in enumerate(engine.groups):
        spec = group.kv_cache_spec
        real = {s // BLOCK_SIZE for s in load.slots(g)}
        if type(spec).__name__ == "FullAttentionSpec":
            assert len(real) == cdiv(n, BLOCK_SIZE)
            continue
        assert len(real) == max_real_blocks(spec, n), (g, sorted(real))
        window = getattr(spec, "sliding_window", None)
        if window is not None:
            assert len(real) <= window_min_blocks(window, BLOCK_SIZE)
    engine.run()


@pytest.mark.parametrize("layout", window_layouts(), ids=lambda lay: lay.name)
def test_store_after_decode_and_reload(make_engine, layout):
    """A 500-token prompt decodes past token 511: chunk 256..511 completes in
    the step that computes token 511, when vLLM has freed the blocks before
    that token's window (the adapter's tracker nulls at least those). The
    window (or attention chunk) is shorter than the chunk, so the chunk has
    tokens in null blocks: it is not stored (a reader with HMA off would read
    them), and no store reads a freed block. A later request with this
    512-token prefix loads chunk 0..255 and computes the rest."""
    engine: Engine = make_engine(layout, hma=True)
    a = engine.add(list(range(3000, 3500)), max_tokens=20)
    engine.step()  # prefill: stores chunk 0..255
    stored = 0
    while a.num_computed_tokens < 2 * CHUNK:
        engine.kernel.reset()
        engine.step()
        copies = [c for c in engine.kernel.copies if c.to_lmcache]
        if copies:
            assert a.num_computed_tokens == 2 * CHUNK  # the chunk is complete
            stored += 1
            for name, buf in engine.buffers.items():
                # The store read, in each layer, only real blocks of A.
                read = {
                    s // BLOCK_SIZE
                    for c in copies
                    if c.ptr == buf.data_ptr()
                    for s in c.slots
                }
                groups_on_buffer = {
                    engine.group_of_layer[n]
                    for n, b in engine.buffers.items()
                    if b.data_ptr() == buf.data_ptr()
                }
                tables = engine.tables(a.request_id)
                assert read <= {
                    b for g in groups_on_buffer for b in tables[g] if b != 0
                }, name
    assert stored == 0
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(list(a.all_token_ids[: 2 * CHUNK]) + [1, 2, 3])
    engine.step()  # checks every token B's attention reads
    assert engine.loads[b.request_id].num_external_tokens == CHUNK
    engine.check_load_slots(b.request_id)
    engine.run()
