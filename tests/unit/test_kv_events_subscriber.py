"""The reference subscriber's index (support/testkit: hmastack_testkit.kv_events):
the subscriber's rule on the README's example, with eagle, and a KV connector's
CPU tier, decoded from msgpack as the publisher encodes it."""

from __future__ import annotations

import msgspec
import pytest
from hmastack_testkit.kv_events import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Group,
    Index,
    KVEventBatch,
    decode_batch,
    needed_blocks,
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


# --- eagle: a hit needs the block after it in every group ---------------------


def eagle(event):
    return msgspec.structs.replace(event, use_eagle=True)


def test_with_eagle_a_hit_needs_the_block_after_it():
    """The README's layout with eagle: the sliding group holds blocks 2, 3, 4.
    A hit of 20 tokens would need block 5 (tokens 20..23, past the last token
    21); one of 16 needs blocks 0..4 in the full group and the window of token
    16 (blocks 2, 3) and block 4 in the sliding group: 16. A subscriber that
    ignores use_eagle claims 20."""
    events = [eagle(stored(FULL, 0, 4, "full_attention")), eagle(sliding(2, 4))]
    assert index_of(events).predict(TOKENS) == 16
    unaware = Index(eagle_aware=False)
    for event in DECODER.decode(
        msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    ).events:
        unaware.apply(event)
    assert unaware.predict(TOKENS) == 20
    # Without eagle the same blocks serve 20 tokens (window of 20: 3, 4).
    assert (
        index_of([stored(FULL, 0, 4, "full_attention"), sliding(2, 4)]).predict(TOKENS)
        == 20
    )


def test_with_eagle_the_block_after_the_hit_must_be_held():
    """Full attention with eagle, a 30-token prompt (7 full blocks, the last
    token in block 7): with blocks 0..4 held the hit is 16 (block 4 after
    it); with blocks 0..6 held, 24 (block 6 after it, ending at token 27)."""
    tokens = list(range(100, 130))
    hashes = [1000 + i for i in range(7)]

    def full_blocks(last: int) -> BlockStored:
        return BlockStored(
            block_hashes=hashes[: last + 1],
            parent_block_hash=None,
            token_ids=tokens[: (last + 1) * B],
            block_size=B,
            lora_id=None,
            medium="GPU",
            group_idx=FULL,
            kv_cache_spec_kind="full_attention",
            use_eagle=True,
        )

    assert index_of([full_blocks(4)]).predict(tokens) == 16
    assert index_of([full_blocks(6)]).predict(tokens) == 24


def test_a_group_known_before_its_events_learns_eagle_from_them():
    """A router that knows the engine's KV cache groups from its
    configuration before their first event (kind, window, block size; the
    configuration does not say eagle) takes use_eagle from the events: the
    README's layout with eagle predicts 16, as an index built from the
    events alone; the same groups that keep use_eagle False claim 20."""
    events = [eagle(stored(FULL, 0, 4, "full_attention")), eagle(sliding(2, 4))]
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    for eagle_aware, expected in ((True, 16), (False, 20)):
        index = Index(eagle_aware=eagle_aware)
        index.groups[FULL] = Group("full_attention", B)
        index.groups[SLIDING] = Group("sliding_window", B, window=8)
        for event in DECODER.decode(payload).events:
            index.apply(event)
        assert [g.use_eagle for g in index.groups.values()] == [eagle_aware] * 2
        assert index.predict(TOKENS) == expected


def test_needed_blocks_of_each_kind():
    assert needed_blocks("full_attention", 4, 16) == range(0, 4)
    assert needed_blocks("full_attention", 4, 16, use_eagle=True) == range(0, 5)
    # window 8 reads tokens 9..16 for token 16: blocks 2, 3
    assert needed_blocks("sliding_window", 4, 16, window=8) == range(2, 4)
    assert needed_blocks("sliding_window", 4, 16, window=8, use_eagle=True) == range(
        2, 5
    )
    # chunk 16: a hit of 16 is a chunk boundary; with eagle block 4 only
    assert needed_blocks("chunked_local_attention", 4, 16, chunk=16) == range(4, 4)
    assert needed_blocks(
        "chunked_local_attention", 4, 16, chunk=16, use_eagle=True
    ) == range(4, 5)
    assert needed_blocks("chunked_local_attention", 4, 20, chunk=16) == range(4, 5)
    # Mamba: the block of token 15, the state after it; eagle adds nothing
    assert needed_blocks("mamba", 4, 16) == range(3, 4)
    assert needed_blocks("mamba", 4, 16, use_eagle=True) == range(3, 4)
    assert needed_blocks("mamba", 4, 0) == range(0, 0)


def test_a_mamba_group_needs_only_the_state_at_the_end_of_the_hit():
    """Full attention holds blocks 0~4 of the 22-token prompt, the Mamba group
    (vLLM caches one state block a hit) only block 3: the hit is 16 tokens,
    the state after token 15; with the Mamba group read as full attention the
    subscriber predicts none."""
    events = [
        stored(FULL, 0, 4, "full_attention"),
        msgspec.structs.replace(stored(SLIDING, 3, 3, "mamba"), parent_block_hash=None),
    ]
    assert index_of(events).predict(TOKENS) == 16
    as_full = [
        events[0],
        msgspec.structs.replace(events[1], kv_cache_spec_kind="full_attention"),
    ]
    assert index_of(as_full).predict(TOKENS) == 0


# --- media: the engine's GPU blocks and a KV connector's CPU tier --------------


def cpu(event):
    return msgspec.structs.replace(
        event, medium="CPU", parent_block_hash=None, token_ids=[]
    )


def test_a_tier_s_blocks_are_not_the_engine_s_prefix_cache():
    """Blocks only the CPU tier holds are no local hit; AllBlocksCleared (the
    engine's prefix cache reset) empties the GPU medium, not the tier."""
    gpu_full = stored(FULL, 0, 4, "full_attention")
    events = [gpu_full, cpu(gpu_full), AllBlocksCleared()]
    index = index_of(events)
    assert index.predict(TOKENS) == 0
    assert index.predict(TOKENS, medium="CPU") == 20
    assert index.groups[FULL].holds("CPU") == set(HASHES)


@pytest.mark.parametrize(
    ("cpu_sliding", "reported"), [((3, 4), 20), ((4,), 8), ((2, 3, 4), 20)]
)
def test_a_tier_extends_the_local_hit_by_what_it_can_load(cpu_sliding, reported):
    """Local hit 8: the engine computed blocks 0..4 and evicted 2..4 in both
    groups; the CPU tier holds blocks 2..4 of the full group and
    `cpu_sliding` of the sliding group. A request of 20 computed tokens reads
    the window of token 20 (blocks 3, 4) in the sliding group: the tier
    extends the hit to 20 when it holds them, else (16 and 12 need block 2
    there) not at all."""
    events = [
        stored(FULL, 0, 4, "full_attention"),
        sliding(0, 4),
        *(removed(FULL, b, "full_attention") for b in (2, 3, 4)),
        *(sliding_removed(b) for b in (2, 3, 4)),
        cpu(stored(FULL, 2, 4, "full_attention")),
        *(cpu(sliding(b, b)) for b in cpu_sliding),
    ]
    index = index_of(events)
    assert index.predict(TOKENS) == 8
    assert index.predict_tier(TOKENS) == reported


def test_a_tier_hit_of_the_whole_prompt_reports_all_but_the_last_token():
    tokens = TOKENS[:20]  # 5 full blocks
    events = [stored(FULL, 0, 4, "full_attention")]
    index = index_of(events + [cpu(events[0])] + [AllBlocksCleared()])
    assert index.predict(tokens) == 0
    assert index.predict_tier(tokens) == 19


@pytest.mark.parametrize(("use_eagle", "control"), [(False, 20), (True, 16)])
def test_a_tier_hit_with_eagle_needs_no_block_after_it(use_eagle, control):
    """The CPU tier holds blocks 0..4 of the 22-token prompt, the local prefix
    cache nothing: the connector loads 20 tokens, with eagle too (its table
    starts earlier, at block 0 either way). The engine's own eagle rule
    applied to the tier (``engine_rule``) needs block 5 after a hit of 20 and
    claims 16, a block less; without eagle it is the same rule."""
    gpu_full = stored(FULL, 0, 4, "full_attention", use_eagle=use_eagle)
    index = index_of([gpu_full, cpu(gpu_full), AllBlocksCleared()])
    assert index.groups[FULL].use_eagle is use_eagle
    assert index.predict_tier(TOKENS) == 20
    assert index.predict_tier(TOKENS, engine_rule=True) == control


def test_decode_batch_takes_the_encoding_or_the_batch():
    batch = KVEventBatch(ts=1.0, events=[sliding(0, 1)])
    payload = msgspec.msgpack.encode(batch)
    assert decode_batch(payload) == batch
    assert decode_batch(batch) == batch
