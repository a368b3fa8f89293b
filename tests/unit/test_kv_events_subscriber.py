"""The reference subscriber's index (support/testkit: hmastack_testkit.kv_events):
the subscriber's rule on the README's example, decoded from msgpack as the
publisher encodes it."""

from __future__ import annotations

import msgspec
import pytest
from hmastack_testkit.kv_events import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Index,
    KVEventBatch,
)

B = 4
TOKENS = list(range(100, 122))  # 22 tokens: 5 full blocks
HASHES = [1000 + i for i in range(5)]
FULL, SLIDING = 0, 1


def stored(group: int, first: int, last: int, kind: str, **spec) -> BlockStored:
    return BlockStored(
        block_hashes=HASHES[first : last + 1],
        parent_block_hash=HASHES[first - 1] if first else None,
        token_ids=TOKENS[first * B : (last + 1) * B],
        block_size=B,
        lora_id=None,
        medium="GPU",
        group_idx=group,
        kv_cache_spec_kind=kind,
        **spec,
    )


def removed(group: int, block: int, kind: str, **spec) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=[HASHES[block]],
        medium="GPU",
        group_idx=group,
        kv_cache_spec_kind=kind,
        **spec,
    )


def index_of(events, by_group: bool = True) -> Index:
    """The index of `events`, through the publisher's msgpack encoding."""
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    index = Index(by_group=by_group)
    for event in DECODER.decode(payload).events:
        index.apply(event)
    return index


def sliding(first: int, last: int) -> BlockStored:
    return stored(
        SLIDING, first, last, "sliding_window", kv_cache_spec_sliding_window=8
    )


def sliding_removed(block: int) -> BlockRemoved:
    return removed(SLIDING, block, "sliding_window", kv_cache_spec_sliding_window=8)


def test_sliding_window_needs_only_the_window_before_the_hit():
    """Full attention + sliding window 8, block size 4, a 22-token request:
    the sliding group evicted blocks 0 and 2; the hit is 20 tokens (it needs
    blocks 3 and 4 there)."""
    events = [
        stored(FULL, 0, 4, "full_attention"),
        sliding(0, 4),
        sliding_removed(0),
        sliding_removed(2),
    ]
    assert index_of(events).predict(TOKENS) == 20


def test_without_the_group_a_subscriber_claims_a_hit_the_engine_cannot_serve():
    """The sliding group holds blocks 1, 2 and 4, not 3: no hit of 20 or 16
    tokens is served there (each needs block 3), 12 is. Ignoring the group
    claims 20."""
    events = [stored(FULL, 0, 4, "full_attention"), sliding(1, 2), sliding(4, 4)]
    assert index_of(events).predict(TOKENS) == 12
    assert index_of(events, by_group=False).predict(TOKENS) == 20


def test_full_attention_needs_every_block_and_the_last_token_is_computed():
    events = [stored(FULL, 0, 4, "full_attention"), removed(FULL, 2, "full_attention")]
    assert index_of(events).predict(TOKENS) == 8
    # A prompt of exactly 5 blocks: its last token is computed, so 16.
    assert index_of(events[:1]).predict(TOKENS[:20]) == 16


@pytest.mark.parametrize(("held", "hit"), [((0, 1, 2, 3, 4), 20), ((0, 1, 2), 16)])
def test_chunked_local_attention_needs_the_blocks_of_the_hits_chunk(held, hit):
    """Chunk 16: a hit of 20 tokens needs block 4 (tokens 16..19); one of 16
    tokens is a chunk boundary and needs none."""
    events = [stored(FULL, 0, 4, "full_attention")] + [
        stored(
            SLIDING,
            b,
            b,
            "chunked_local_attention",
            kv_cache_spec_attention_chunk_size=16,
        )
        for b in held
    ]
    assert index_of(events).predict(TOKENS) == hit


def test_events_without_the_group_fields_are_one_full_attention_group():
    """An engine with the hybrid KV cache manager off (or without the new
    fields): the events decode, and form one full attention group."""
    event = stored(FULL, 0, 4, "full_attention")
    plain = msgspec.structs.replace(event, group_idx=None, kv_cache_spec_kind=None)
    index = index_of([plain])
    assert index.predict(TOKENS) == 20
    assert list(index.groups) == [0]


def test_all_blocks_cleared_empties_every_group():
    events = [stored(FULL, 0, 4, "full_attention"), sliding(0, 4), AllBlocksCleared()]
    assert index_of(events).predict(TOKENS) == 0
