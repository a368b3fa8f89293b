"""LMCache retrieves fewer chunks than it claimed: a failed load.

Between LMCache's lookup (scheduler) and its retrieve (worker) a chunk can go
(evicted, a backend that cannot read it). The retrieve then returns a mask of
the tokens it wrote; the adapter reports the blocks of every token it did not
write (``get_block_ids_with_load_errors``) and vLLM's recovery (stage
``00c``, ``03``) computes them again. Every token the mask says was
retrieved must have been written: a token reported neither as loaded nor
as failed is read as KV that is not there.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine
from layouts import CHUNK

PROMPT = list(range(5000, 6100))  # 1100 tokens; LMCache stores [0, 1024)


def fail_chunks_before_the_load(engine: Engine, token_ids, chunks) -> None:
    """LMCache loses ``chunks`` of ``token_ids`` after the scheduler's lookup
    and before the worker's retrieve (the next ``start_load_kv``)."""
    start_load_kv = engine.worker.start_load_kv

    def evict_then_load(forward_context, **kwargs):
        engine.evict_lmcache_chunks(token_ids, chunks)
        engine.worker.start_load_kv = start_load_kv
        return start_load_kv(forward_context, **kwargs)

    engine.worker.start_load_kv = evict_then_load


def step_that_fails(engine: Engine) -> None:
    """The step that loads, without checking what it reads: it runs its
    forward pass with what the load wrote, and the failure, reported with its
    output, makes vLLM drop what it computed (stage 00c). The steps after it
    read only what the recovery kept, and are checked."""
    check_reads = engine.check_reads
    engine.check_reads = lambda so: None
    try:
        engine.step()
    finally:
        engine.check_reads = check_reads


@pytest.mark.parametrize("failed_chunk", [1, 2, 3])
@pytest.mark.parametrize(
    "layout",
    [
        layouts.full_attention_only(),
        layouts.gpt_oss_like(),
        layouts.gemma3_like(),
        layouts.llama4_like(),
    ],
    ids=lambda lay: lay.name,
)
def test_failed_chunk_is_a_failed_load(make_engine, layout, failed_chunk):
    """LMCache claims 1024 tokens (chunks 0..3) and loses chunk
    ``failed_chunk`` before the retrieve: the chunks before it are loaded,
    the blocks of the tokens from it on are reported, and the request
    computes them again. Every token each later step reads holds its KV
    (``Engine.step``), the chunk before the failed one included."""
    check_failed_chunk(make_engine(layout, hma=True), failed_chunk)


@pytest.mark.parametrize("failed_chunk", [1, 3])
@pytest.mark.parametrize(
    "layout",
    [layouts.gpt_oss_like(48), layouts.gemma3_like(64)],
    ids=lambda lay: lay.name,
)
def test_failed_chunk_with_eagle(make_engine, layout, failed_chunk):
    """The same with eagle: the sliding-window tables start one block
    earlier (the window of the hit a later request takes)."""
    check_failed_chunk(make_engine(layout, hma=True, use_eagle=True), failed_chunk)


def check_failed_chunk(engine: Engine, failed_chunk: int) -> None:
    """A stores PROMPT; B's load of its first 1024 tokens loses chunk
    ``failed_chunk``; B finishes reading only correct KV and stores the
    chunks it computed again."""
    engine.add(PROMPT)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    b = engine.add(PROMPT[:1024] + [1, 2, 3])
    fail_chunks_before_the_load(engine, PROMPT[:1024], [failed_chunk])
    step_that_fails(engine)
    load = engine.loads[b.request_id]
    assert (load.num_local_tokens, load.num_external_tokens) == (0, 1024)
    request = engine.requests[b.request_id]
    # The recovery keeps what was loaded before the failed chunk, at most.
    assert request.num_computed_tokens <= failed_chunk * CHUNK
    engine.run()  # checks every token the later steps read
    assert engine.requests[b.request_id].is_finished()
    # B computed the lost chunk again and stored it: LMCache holds every
    # chunk of the prefix, each with its tokens' KV.
    engine.check_stored_prefix(PROMPT[:1024])


def test_failed_partial_chunk_after_a_local_hit(make_engine, monkeypatch):
    """With ``save_unfull_chunk``, LMCache also stores a prompt's last,
    partial chunk. The request has a prefix-cache hit of 320 tokens, so
    LMCache's load starts at 256 and moves 64 tokens of the hit; LMCache
    loses the partial chunk (1024..1071) before the retrieve. The tokens of
    the hit that the load moves are no reason to count the partial chunk
    as loaded: its blocks are a failed load and computed again."""
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config

    monkeypatch.setattr(lmcache_get_or_create_config(), "save_unfull_chunk", True)
    engine: Engine = make_engine(layouts.full_attention_only(), hma=True)
    prompt = PROMPT[:1072]
    engine.add(prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add(prompt[:330])
    engine.run()  # vLLM's prefix cache holds tokens 0..319
    b = engine.add(prompt)
    fail_chunks_before_the_load(engine, prompt, [4])
    step_that_fails(engine)
    load = engine.loads[b.request_id]
    assert (load.num_local_tokens, load.num_external_tokens) == (320, 751)
    assert engine.requests[b.request_id].num_computed_tokens <= 1024
    engine.run()
    assert engine.requests[b.request_id].is_finished()
