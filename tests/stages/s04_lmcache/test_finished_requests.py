"""Kind 5: stores of requests that finish.

vLLM calls ``request_finished_all_groups`` with the block table of every KV
cache group (sliding-window tables start with null blocks) and frees the
blocks at once unless the connector returns True. LMCache stores in
``wait_for_save`` of the step that computed the tokens, so a request that
finishes in the step that completes a chunk has that chunk stored, from each
layer's own group's real blocks, before vLLM frees them; null ids are never
read. The test then overwrites every block the request held (as the next
requests would) and loads the prefix back.
"""

from __future__ import annotations

import pytest
import torch
from s04_lmcache import layouts
from s04_lmcache.conftest import CHUNK
from s04_lmcache.harness import NULL_BLOCK_SENTINEL, Engine
from s04_lmcache.layouts import BLOCK_SIZE


@pytest.mark.parametrize(
    "layout",
    [layouts.gemma3_like(128), layouts.gpt_oss_like(), layouts.llama4_like()],
    ids=lambda lay: lay.name,
)
def test_request_finishing_in_the_step_that_completes_a_chunk(make_engine, layout):
    engine: Engine = make_engine(layout, hma=True)
    # Prefill 0..499, then decode: the 13th output token is sampled by the
    # step that computes token 511, which completes chunk 256..511.
    a = engine.add(list(range(3000, 3500)), max_tokens=13)
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

    # What LMCache holds for chunk 256..511: in each layer, the request's KV
    # for tokens in real blocks of the layer's group, zeros for tokens in
    # null blocks (never the null block's content).
    tokens = list(a.all_token_ids[: 2 * CHUNK])
    chunk = engine.stored_chunks(tokens)[1]
    assert chunk is not None
    for layer, name in enumerate(engine.buffers):
        table = tables[engine.group_of_layer[name]]
        want = engine.expected_kv(tokens, layer)[CHUNK:]
        for t in range(CHUNK):
            k = chunk[0, layer, t]
            assert not bool((k == NULL_BLOCK_SENTINEL).any()), (name, t)
            if table[(CHUNK + t) // BLOCK_SIZE] == 0:
                assert not bool(k.any()), (name, CHUNK + t)
            else:
                assert bool((k == want[t]).all()), (name, CHUNK + t)
                assert bool((chunk[1, layer, t] == -want[t]).all())

    # The freed blocks are reused: overwrite them all, then load the prefix.
    for name, buf in engine.buffers.items():
        ids = [b for b in tables[engine.group_of_layer[name]] if b != 0]
        buf[:, torch.tensor(ids)] = 4242.0
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(tokens + [1, 2, 3])
    engine.step()  # checks every token B's attention reads
    assert engine.loads[b.request_id].num_external_tokens == 2 * CHUNK
    engine.run()
