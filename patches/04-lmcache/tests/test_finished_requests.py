"""Kind 5: stores of requests that finish.

vLLM calls ``request_finished_all_groups`` with the block table of every KV
cache group (sliding-window tables start with null blocks) and frees the
blocks at once unless the connector returns True. LMCache stores in
``wait_for_save`` of the step that computed the tokens, so a request that
finishes in the step that completes a chunk has that chunk stored, from each
layer's own group's real blocks, before vLLM frees them; null ids are never
read. The test then overwrites every block the request held (as the next
requests would) and loads the prefix back.

A chunk is stored only with every token in a real block of every group (a
reader with HMA off reads them all): the windows here keep the finishing
chunk's tokens; a chunk whose first tokens left the window before it
completed is not stored (``test_chunk_contents.py``).
"""

from __future__ import annotations

import layouts
import pytest
import torch
from harness import NULL_BLOCK_SENTINEL, Engine
from layouts import BLOCK_SIZE, CHUNK


@pytest.mark.parametrize(
    "layout",
    [layouts.gemma3_like(512), layouts.gpt_oss_like(384), layouts.llama4_like()],
    ids=lambda lay: lay.name,
)
def test_request_finishing_in_the_step_that_completes_a_chunk(make_engine, layout):
    engine: Engine = make_engine(layout, hma=True)
    # Prefill 0..999, then decode: the 25th output token is sampled by the
    # step that computes token 1023, which completes chunk 768..1023; the
    # tables start with null blocks (tokens 0..511, 0..639, 0..767).
    a = engine.add(list(range(3000, 4000)), max_tokens=25)
    while not engine.finished:
        engine.step()
    (finished,) = engine.finished
    assert finished.request_id == a.request_id
    assert finished.result == (False, None)  # nothing held after the step
    tables = finished.block_ids
    assert len(tables) == len(engine.groups)
    windowed = [
        g
        for g, group in enumerate(engine.groups)
        if type(group.kv_cache_spec).__name__ != "FullAttentionSpec"
    ]
    assert all(tables[g][0] == 0 for g in windowed)  # null ids in those tables

    # What LMCache holds for chunk 768..1023: in each layer, the request's
    # KV of every token (never zeros, never the null block's content).
    tokens = list(a.all_token_ids[: 4 * CHUNK])
    chunk = engine.stored_chunks(tokens)[3]
    assert chunk is not None
    for layer, name in enumerate(engine.buffers):
        table = tables[engine.group_of_layer[name]]
        assert table[3 * CHUNK // BLOCK_SIZE] != 0, name
        want = engine.expected_kv(tokens, layer)[3 * CHUNK :]
        assert not bool((chunk[:, layer] == NULL_BLOCK_SENTINEL).any()), name
        assert bool((chunk[0, layer] == want[:, None]).all()), name
        assert bool((chunk[1, layer] == -want[:, None]).all()), name

    # The freed blocks are reused: overwrite them all, then load the prefix.
    for name, buf in engine.buffers.items():
        ids = [b for b in tables[engine.group_of_layer[name]] if b != 0]
        buf[:, torch.tensor(ids)] = 4242.0
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(tokens + [1, 2, 3])
    engine.step()  # checks every token B's attention reads
    assert engine.loads[b.request_id].num_external_tokens == 4 * CHUNK
    engine.run()
