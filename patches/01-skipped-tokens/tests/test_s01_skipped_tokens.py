"""Stage 01 (skipped tokens + admission count), checked through vLLM's objects.

Complementary to the vLLM unit tests of the patch: these draw inputs with
hypothesis and interleave several requests on one shared block pool.
"""

import pytest
from hmastack_testkit.kvtest import (
    GROUP_KINDS,
    hypothesis_settings,
    make_kv_cache_config,
    make_request,
    make_spec,
)
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
)

SETTINGS = hypothesis_settings(150)


def expected_skipped_tokens(kind: str, window: int, n: int) -> int:
    """The definition per attention type (docs/regions.md, "Skipped tokens
    per attention type"), written from the attention, not from vLLM."""
    return {
        "full": 0,
        "cross_attention": 0,
        "sliding_window": max(0, n - window + 1),
        "chunked_local": n // window * window,
        "mamba": max(0, n - 1),
    }[kind]


KINDS = ["full", "sliding_window", "chunked_local", "mamba", "cross_attention"]


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.integers(1, 80),
    n=st.integers(0, 400),
)
def test_skipped_tokens_follow_the_brief(kind, block_size, window, n):
    pool = BlockPool(64, enable_caching=True, hash_block_size=block_size)
    manager = get_manager_for_kv_cache_spec(
        make_spec(kind, block_size, window), block_pool=pool, kv_cache_group_id=0
    )
    skipped = manager.get_num_skipped_tokens(n)
    assert skipped == expected_skipped_tokens(kind, window, n)
    assert 0 <= skipped <= n
    assert manager.get_num_skipped_tokens(n + 1) >= skipped


@SETTINGS
@given(
    kind=st.sampled_from(["full", "sliding_window", "chunked_local"]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.integers(1, 40),
    steps=st.lists(st.integers(1, 20), min_size=1, max_size=8),
)
def test_remove_skipped_blocks_nulls_exactly_the_skipped_blocks(
    kind, block_size, window, steps
):
    """After each step, the leading null blocks of a running request are the
    blocks that hold only skipped tokens, and they went back to the pool."""
    pool = BlockPool(400, enable_caching=True, hash_block_size=block_size)
    manager = get_manager_for_kv_cache_spec(
        make_spec(kind, block_size, window), block_pool=pool, kv_cache_group_id=0
    )
    num_computed = 0
    for num_new in steps:
        manager.remove_skipped_blocks("r", num_computed)
        manager.allocate_new_blocks("r", num_computed + num_new)
        num_computed += num_new
        manager.remove_skipped_blocks("r", num_computed)
        blocks = manager.req_to_blocks["r"]
        num_null = sum(b.is_null for b in blocks)
        assert all(b.is_null for b in blocks[:num_null])
        assert num_null == manager.get_num_skipped_tokens(num_computed) // block_size
        held = len(blocks) - num_null
        assert pool.get_num_free_blocks() == 399 - held


GROUPS = GROUP_KINDS


@st.composite
def scenarios(draw):
    groups = draw(st.sampled_from(GROUPS))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.integers(1, 4 * block_size + 3))
    use_eagle = groups in (["full"], ["sliding_window"]) and draw(st.booleans())
    num_blocks = draw(st.integers(4, 30)) * len(groups)
    prefix_len = draw(st.integers(0, 6 * block_size))
    num_requests = draw(st.integers(1, 4))
    tails = draw(
        st.lists(
            st.integers(1, 3 * block_size),
            min_size=num_requests,
            max_size=num_requests,
        )
    )
    # Each action: (request index, tokens to schedule, lookahead, free it?)
    actions = draw(
        st.lists(
            st.tuples(
                st.integers(0, num_requests - 1),
                st.integers(1, 4 * block_size),
                st.integers(0, 3),
                st.booleans(),
            ),
            max_size=25,
        )
    )
    return groups, block_size, window, use_eagle, num_blocks, prefix_len, tails, actions


@SETTINGS
@given(scenarios())
def test_admission_count_is_exact_for_interleaved_requests(scenario):
    """Requests sharing a prefix are scheduled in an arbitrary interleaving on
    one pool; before every allocation, the coordinator's count equals the
    blocks the allocation takes from the free queue, and a refusal happens
    exactly when the count exceeds the free blocks."""
    groups, block_size, window, use_eagle, num_blocks, prefix_len, tails, actions = (
        scenario
    )
    kv_cache_config = make_kv_cache_config(groups, block_size, window, num_blocks)
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len=4096,
        hash_block_size=block_size,
        enable_caching=True,
        use_eagle=use_eagle,
    )
    pool = manager.block_pool
    prefix = list(range(prefix_len))
    requests = [
        make_request(str(i), prefix + [10_000 + i] * tail, block_size)
        for i, tail in enumerate(tails)
    ]
    finished: set[int] = set()
    for index, num_tokens, lookahead, free_it in actions:
        if index in finished:
            continue
        request = requests[index]
        if free_it:
            manager.free(request)
            finished.add(index)
            continue
        hits, num_hit_tokens = manager.empty_kv_cache_blocks, 0
        if request.num_computed_tokens == 0 and not manager.get_blocks(
            request.request_id
        ).get_block_ids(allow_none=True):
            hits, num_hit_tokens = manager.get_computed_blocks(request)
        num_computed = request.num_computed_tokens + num_hit_tokens
        if num_computed >= request.num_tokens:
            request.append_output_token_ids(7)
        num_new = min(num_tokens, request.num_tokens - num_computed)
        manager.coordinator.remove_skipped_blocks(
            request.request_id, request.num_computed_tokens
        )
        predicted = manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=min(num_computed + num_new + lookahead, 4096),
            new_computed_blocks=hits.blocks,
            num_encoder_tokens=0,
            num_computed_tokens=num_computed,
        )
        free_before = pool.get_num_free_blocks()
        result = manager.allocate_slots(
            request, num_new, num_hit_tokens, hits, num_lookahead_tokens=lookahead
        )
        if result is None:
            assert predicted > free_before
            assert pool.get_num_free_blocks() == free_before
            continue
        assert free_before - pool.get_num_free_blocks() == predicted
        request.num_computed_tokens = num_computed + num_new
    # No block has two owners and nothing leaked.
    for request in requests:
        manager.free(request)
    assert pool.get_num_free_blocks() == num_blocks - 1


def test_running_request_fast_path_is_exact_and_never_negative():
    """A running request that asks for fewer slots than it holds (less
    lookahead than in the previous step) is counted as 0 in every group, so
    it cannot hide another group's need."""
    block_size = 4
    kv_cache_config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], make_spec("full", block_size, 0)),
            KVCacheGroupSpec(["b"], make_spec("sliding_window", block_size, 8)),
        ],
    )
    manager = KVCacheManager(
        kv_cache_config, max_model_len=4096, hash_block_size=block_size
    )
    request = make_request("r", list(range(10)), block_size)
    assert manager.allocate_slots(request, 10, num_lookahead_tokens=8) is not None
    request.num_computed_tokens = 10
    request.append_output_token_ids(1)
    count = manager.coordinator.get_num_blocks_to_allocate(
        request_id="r",
        num_tokens=11,
        new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        num_computed_tokens=10,
    )
    assert count == 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
