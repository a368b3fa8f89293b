"""Stage 02 (null padding where computed blocks are saved), checked through
vLLM's objects.

Complementary to the vLLM unit tests of the patch: hypothesis draws the
layout, the hits (from a real lookup after other requests ran) and the tokens
computed outside the prefix cache; every allocation is checked against
ownership and KV cache event invariants on one shared pool.
"""

from hmastack_testkit.kvtest import (
    GROUP_KINDS,
    hypothesis_settings,
    make_kv_cache_config,
    make_request,
    make_spec,
)
from hypothesis import given
from hypothesis import strategies as st
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

SETTINGS = hypothesis_settings(150)


# Full attention alone has nothing to pad.
GROUPS = [kinds for kinds in GROUP_KINDS if kinds != ["full"]]


def check_pool(manager: KVCacheManager, live: list[Request]) -> None:
    """Every real block's ref_cnt is the number of block tables holding it
    (no block has an owner it does not count); ref_cnt == 0 exactly for the
    blocks in the free queue; the null block is never cached; null blocks
    only form a prefix of a table."""
    pool = manager.block_pool
    owners: dict[int, int] = {}
    for request in live:
        for table in manager.coordinator.get_blocks(request.request_id):
            num_null = sum(b.is_null for b in table)
            assert all(b.is_null for b in table[:num_null])
            for block in table[num_null:]:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
    assert pool.null_block.block_hash is None
    assert pool.null_block.block_id not in free_ids


@st.composite
def scenarios(draw):
    groups = draw(st.sampled_from(GROUPS))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.integers(1, 4 * block_size + 3))
    num_blocks = draw(st.integers(6, 30)) * len(groups)
    prefix_len = draw(st.integers(0, 8 * block_size))
    # Each step: tail length of a new request, how many of its remaining
    # tokens are computed outside the prefix cache (per mille), new tokens
    # per mille, and whether to free the oldest live request first.
    steps = draw(
        st.lists(
            st.tuples(
                st.integers(1, 3 * block_size),
                st.integers(0, 1000),
                st.integers(1, 1000),
                st.booleans(),
            ),
            min_size=1,
            max_size=10,
        )
    )
    return groups, block_size, window, num_blocks, prefix_len, steps


@SETTINGS
@given(scenarios())
def test_saving_computed_blocks_pads_claims_and_counts_exactly(scenario):
    groups, block_size, window, num_blocks, prefix_len, steps = scenario
    manager = KVCacheManager(
        make_kv_cache_config(groups, block_size, window, num_blocks),
        max_model_len=4096,
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    coordinator = manager.coordinator
    pool = manager.block_pool
    prefix = list(range(prefix_len))
    live: list[Request] = []
    for i, (tail, external_pm, new_pm, free_oldest) in enumerate(steps):
        if free_oldest and live:
            manager.free(live.pop(0))
        request = make_request(str(i), prefix + [10_000 + i] * tail, block_size)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        hit_refs = [[b.ref_cnt for b in group] for group in hits.blocks]
        room = request.num_tokens - num_hit_tokens - 1
        num_external = room * external_pm // 1000
        num_computed = num_hit_tokens + num_external
        num_new = max(1, (request.num_tokens - num_computed) * new_pm // 1000)
        num_tokens = num_computed + num_new

        predicted = coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=num_tokens,
            new_computed_blocks=hits.blocks,
            num_encoder_tokens=0,
            num_computed_tokens=num_computed,
        )
        free_before = pool.get_num_free_blocks()
        if predicted > free_before:
            continue
        coordinator.save_new_computed_blocks(
            request.request_id, hits.blocks, num_computed
        )
        for manager_i, group_hits, refs in zip(
            coordinator.single_type_managers, hits.blocks, hit_refs, strict=False
        ):
            num_skipped_blocks = (
                manager_i.get_num_skipped_tokens(num_computed) // block_size
            )
            table = manager_i.req_to_blocks[request.request_id]
            # The table is the skipped prefix as null blocks, then the hits.
            assert len(table) == max(num_skipped_blocks, len(group_hits))
            assert all(b.is_null for b in table[:num_skipped_blocks])
            assert table[num_skipped_blocks:] == list(group_hits[num_skipped_blocks:])
            assert manager_i.num_cached_block[request.request_id] == len(table)
            # Only the hits after the skipped prefix are claimed.
            for j, (block, ref) in enumerate(zip(group_hits, refs, strict=False)):
                if not block.is_null:
                    assert block.ref_cnt == ref + (j >= num_skipped_blocks)
        coordinator.allocate_new_blocks(request.request_id, num_tokens)
        assert free_before - pool.get_num_free_blocks() == predicted

        # Publishing: null blocks never, and each event's parent is the
        # request's own hash of the block before the first stored one.
        manager.take_events()
        manager.cache_blocks(request, num_tokens)
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
        for event in manager.take_events():
            if not isinstance(event, BlockStored):
                continue
            first = hashes.index(event.block_hashes[0])
            assert event.block_hashes == hashes[first : first + len(event.block_hashes)]
            assert event.parent_block_hash == (hashes[first - 1] if first else None)
            assert (
                event.token_ids
                == request.all_token_ids[
                    first * block_size : (first + len(event.block_hashes)) * block_size
                ]
            )
        request.num_computed_tokens = num_tokens
        live.append(request)
        check_pool(manager, live)

    for request in live:
        manager.free(request)
    check_pool(manager, [])
    assert pool.get_num_free_blocks() == num_blocks - 1


def test_running_request_never_gets_new_computed_blocks():
    block_size = 4
    manager = KVCacheManager(
        KVCacheConfig(
            num_blocks=20,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["a"], make_spec("sliding_window", block_size, 4))
            ],
        ),
        max_model_len=4096,
        hash_block_size=block_size,
    )
    donor = make_request("donor", list(range(12)), block_size)
    assert manager.allocate_slots(donor, 12) is not None
    request = make_request("r", list(range(12)), block_size)
    assert manager.allocate_slots(request, 4) is not None
    request.num_computed_tokens = 4
    hits = manager.get_computed_blocks(make_request("x", list(range(12)), block_size))
    try:
        manager.coordinator.save_new_computed_blocks("r", hits[0].blocks, 8)
    except AssertionError:
        pass
    else:
        raise AssertionError("a running request accepted new computed blocks")
