"""Layers that reuse another layer's KV cache (Gemma-3n).

vLLM gives such a layer (``kv_sharing_target_layer_name``) no KV cache spec:
it is in no KV cache group of the configuration the connector gets, but it is
in the forward context, with its target's KV cache tensor. The adapter copies
it with its target's group (its chunk entry is a copy of the target's, as
LMCache 0.3.11 stores it).
"""

from __future__ import annotations

import layouts
import pytest
from layouts import CHUNK

PROMPT = list(range(1000, 2100))  # 1100 tokens; LMCache stores [0, 1024)


@pytest.mark.parametrize("hma", [True, False])
def test_layers_sharing_a_kv_cache_are_stored_and_loaded(make_engine, hma):
    layout = layouts.gemma3n_like()
    engine = make_engine(layout, hma=hma)
    grouped = {
        name
        for group in engine.worker_config.kv_cache_groups
        for name in group.layer_names
    }
    assert layout.layer_name(10) not in grouped
    engine.add(PROMPT)
    engine.run()
    chunks = engine.stored_chunks(PROMPT[:1024])
    assert all(chunk is not None for chunk in chunks)
    for chunk in chunks:
        # LMCache's layers 0..9 have their own KV caches (checked below); 10
        # and 11 are copies of 4 and 5.
        assert chunk.shape[1:3] == (12, CHUNK)
        assert bool((chunk[:, 10] == chunk[:, 4]).all())
        assert bool((chunk[:, 11] == chunk[:, 5]).all())
    engine.check_stored_prefix(PROMPT[:1024])  # layers 0..9
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(PROMPT[:1024] + list(range(7000, 7040)))
    engine.step()  # checks every token B's attention reads
    assert engine.loads[b.request_id].num_external_tokens == 1024
    engine.check_load_slots(b.request_id)
    engine.run()
