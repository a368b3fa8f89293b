"""What an LMCache chunk holds: the K and V of every token in every layer.

LMCache keys a chunk by its token prefix (and the model), not by the KV cache
layout of the vLLM that wrote it: vLLM with HMA off (every layer reads every
token), a vLLM with other sliding windows, or another instance reads the same
chunk. With HMA, a sliding-window (or chunked local) group's tokens leave the
window and their blocks are freed while a chunk is still being computed
(chunked prefill, decode). A chunk with such a token must not be stored: it
would hold zeros there, and a reader that reads that token takes them for
real KV. The chunks LMCache does store are checked token by token, layer by
layer, i.e. as a reader with HMA off reads them.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine
from layouts import CHUNK

PROMPT = list(range(1000, 2100))  # 1100 tokens


def check_stored_chunks_are_whole(engine: Engine, token_ids: list[int]) -> int:
    """Every chunk LMCache holds for ``token_ids`` has every layer's K and V
    of every token; returns how many chunks it holds."""
    chunks = engine.stored_chunks(token_ids)
    for layer in range(len(engine.buffers)):
        want = engine.expected_kv(token_ids, layer)
        for i, chunk in enumerate(chunks):
            if chunk is None:
                continue
            w = want[i * CHUNK : (i + 1) * CHUNK, None]
            bad = ((chunk[0, layer] != w).any(-1)).nonzero().flatten().tolist()
            assert not bad, (
                f"chunk {i} layer {layer}: tokens {[i * CHUNK + t for t in bad][:4]}"
                f"... hold K {chunk[0, layer, bad[0], 0].item()}, want "
                f"{w[bad[0], 0].item()}"
            )
            assert bool((chunk[1, layer] == -w).all()), (i, layer, "V")
    return sum(chunk is not None for chunk in chunks)


@pytest.mark.parametrize(
    ("layout", "num_stored"),
    # Steps of 200 tokens. gpt-oss-like (W=128): chunk 0 completes when
    # tokens 0..63 have left the window, chunk 1 when 0..271 have; only
    # chunk 2 (completed at 600, window from 473) is whole. Gemma-3-like
    # (W=512): every chunk is whole when it completes. Llama-4-like
    # (A=384): chunk 1 completes in the step from 400, when tokens 0..383
    # are skipped; chunks 0, 2 and 3 are whole.
    [
        (layouts.gpt_oss_like(128), 1),
        (layouts.gemma3_like(512), 4),
        (layouts.llama4_like(384), 3),
    ],
    ids=lambda v: v.name if hasattr(v, "name") else str(v),
)
def test_chunked_prefill_stores_only_whole_chunks(make_engine, layout, num_stored):
    engine = make_engine(layout, hma=True)
    engine.scheduler.max_num_scheduled_tokens = 200
    engine.add(PROMPT)
    engine.run()
    assert check_stored_chunks_are_whole(engine, PROMPT[:1024]) == num_stored


def test_decode_stores_only_whole_chunks(make_engine):
    """gpt-oss-like (W=128): the chunk that decode completes (256..511) has
    lost tokens 256..383 from the window; it is not stored. The prompt's
    chunk, computed in one step, is."""
    engine = make_engine(layouts.gpt_oss_like(128), hma=True)
    a = engine.add(list(range(3000, 3500)), max_tokens=13)
    engine.run()
    tokens = list(a.all_token_ids[: 2 * CHUNK])
    assert check_stored_chunks_are_whole(engine, tokens) == 1
    assert engine.stored_chunks(tokens)[1] is None


def test_hma_off_stores_every_chunk(make_engine):
    """Negative control: with HMA off nothing is null, every chunk is stored
    (the rule costs nothing there)."""
    engine = make_engine(layouts.gpt_oss_like(128), hma=False)
    engine.scheduler.max_num_scheduled_tokens = 200
    engine.add(PROMPT)
    engine.run()
    assert check_stored_chunks_are_whole(engine, PROMPT[:1024]) == 4
