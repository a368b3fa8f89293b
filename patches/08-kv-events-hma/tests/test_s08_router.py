"""Stage 08: a router built only from the KV cache events predicts every hit the
real `Scheduler` reports, with eagle and with OffloadingConnector's CPU tier.

The scheduler publishes its events through vLLM's own ZMQ publisher
(``--kv-events-config`` with ``publisher: zmq``) to the reference subscriber of
``hmastack_testkit.kv_events`` on 127.0.0.1, which decodes them with structs of
its own and keeps the router's index (``hmastack_testkit.router``). Requests
with shared prefixes run one after another in a small pool (evictions); before
each one the subscriber has received every event so far and predicts the
request's cached tokens, which the scheduler then reports
(``Request.num_cached_tokens``).

- Eagle (``SpeculativeConfig`` whose ``use_eagle()`` is true: an eagle draft
  model cannot run on CPU, the scheduler only asks that), on the
  Gemma-3-like, gpt-oss-like and Llama-4-like layouts and one group, and
  without eagle: :meth:`Index.predict` is the hit; the control that ignores
  the events' ``use_eagle`` claims more than the scheduler serves. (A
  Llama-4-like engine with eagle runs with the hybrid KV cache manager off,
  one full attention group: the Scheduler here is given the groups, so the
  rule is checked for the chunked local attention manager's lookup too.)
- OffloadingConnector (vLLM's LRU manager over a CPU backend, its worker
  side with the testkit's CPU spec), Gemma-3-like and gpt-oss-like: the CPU
  tier's events name block hashes the engine published in the same group,
  and :meth:`Index.predict_tier` (the local hit from the ``GPU`` events,
  extended by what the ``CPU`` events hold) is the hit the scheduler
  reports, also after the local prefix cache is emptied.
"""

from __future__ import annotations

import pytest
from hmastack_testkit.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
)
from hmastack_testkit.router import EAGLE_CONTROL, TIER_CONTROL, Router

LAYOUTS = {
    "gemma3_like": ["sliding_window"] * 5 + ["full"],
    "gpt_oss_like": ["full", "sliding_window"],
    "llama4_like": ["chunked_local"] * 3 + ["full"],
    "one_group": ["full"],
}


@pytest.fixture
def router_factory():
    routers: list[Router] = []

    def make(*args, **kwargs) -> Router:
        router = Router(*args, **kwargs)
        routers.append(router)
        return router

    yield make
    for router in routers:
        router.close()


@pytest.mark.parametrize("use_eagle", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_router_predicts_every_hit(router_factory, layout: str, use_eagle: bool):
    """With and without eagle, every layout: the index kept from the events
    predicts every hit; with eagle, a subscriber that ignores ``use_eagle``
    claims more than the scheduler serves."""
    kinds = LAYOUTS[layout]
    router = router_factory(kinds, 1 + 30 * len(kinds), use_eagle)
    router.stream(seed=8, num_requests=24)
    counts = router.count(True)
    control = router.count(EAGLE_CONTROL)
    print(layout, "eagle" if use_eagle else "", counts, "control", control)
    assert counts["hits"] >= 8, counts
    assert router.subscriber.indexes[True].num_removed > 0, "no eviction"
    assert router.subscriber.gaps == 0
    assert counts["mispredicted"] == 0, [
        (i, reported, p[True])
        for i, (reported, p) in enumerate(router.records)
        if reported != p[True]
    ]
    if use_eagle:
        assert control["overpredicted"] > 0, control
    else:
        assert control == counts


@pytest.mark.parametrize("use_eagle", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_router_predicts_every_hit_with_offloading_connector(
    router_factory, layout: str, use_eagle: bool
):
    """OffloadingConnector's CPU tier, with and without eagle, every layout:
    its events name block hashes the engine published in the same group and
    say ``use_eagle`` as the engine's do; the index of the GPU and CPU events
    predicts every hit, the local prefix cache emptied every sixth request.
    With eagle, the engine's own rule (the block after the hit) applied to
    the CPU tier mispredicts: a hit the connector loads needs no such
    block."""
    kinds = LAYOUTS[layout]
    router = router_factory(kinds, 1 + 30 * len(kinds), use_eagle, offloading=True)
    published: dict[tuple[str, int | None], set] = {}

    def check(event) -> None:
        if isinstance(event, (BlockStored, BlockRemoved)):
            assert event.group_idx is not None
            assert event.kv_cache_spec_kind is not None
            assert event.use_eagle is use_eagle
            key = (event.medium, event.group_idx)
            if isinstance(event, BlockStored):
                if event.medium == MEDIUM_CPU:
                    seen = published.get((MEDIUM_GPU, event.group_idx), set())
                    assert set(event.block_hashes) <= seen
                published.setdefault(key, set()).update(event.block_hashes)
            else:
                assert set(event.block_hashes) <= published.get(key, set())

    apply = router.subscriber.indexes[True].apply

    def checked_apply(event) -> None:
        check(event)
        apply(event)

    router.subscriber.indexes[True].apply = checked_apply
    router.stream(seed=8, num_requests=24, tier=True)
    counts = router.count(True)
    print(layout, counts, {k: len(v) for k, v in published.items()})
    cpu_groups = {g for medium, g in published if medium == MEDIUM_CPU}
    assert cpu_groups == set(range(len(kinds)))
    assert router.subscriber.gaps == 0
    assert counts["hits"] >= 8, counts
    assert counts["tier hits"] >= 4, counts
    assert counts["mispredicted"] == 0, [
        (i, reported, p[True])
        for i, (reported, p) in enumerate(router.records)
        if reported != p[True]
    ]
    control = router.count(TIER_CONTROL)
    if use_eagle:
        assert control["mispredicted"] > 0, control
    else:
        assert control == counts
