"""Stage 09: the reference subscriber's index (``hmastack_testkit.kv_events``)
predicts the hits of OffloadingConnector's CPU tier for a Mamba hybrid.

The real Scheduler with a full attention and a Mamba group (16-token blocks,
prefix caching), OffloadingConnector with the testkit's CPU spec and KV cache
events through vLLM's ZMQ publisher to the reference subscriber
(:class:`hmastack_testkit.router.Router`, as stage 08's router test runs it).
Before each request the index predicts its cached tokens, which the
scheduler then reports. The local prefix cache is emptied before every other
request, so the CPU tier serves it.

With a Mamba group the tokens the tier loads end on the last block boundary
before the prompt's last token (the state after the last of them is loaded,
and the last token is computed from the state before it): a prompt of whole
blocks gets one block less than with attention layers alone. The rule of
attention layers alone (:meth:`Index.predict_tier` without the Mamba case)
predicts 63 of a 64-token prompt, where the scheduler reports 48.
"""

from __future__ import annotations

import pytest
from hmastack_testkit.router import Router

NUM_BLOCKS = 64


@pytest.fixture
def router():
    router = Router(["full", "mamba"], NUM_BLOCKS, use_eagle=False, offloading=True)
    yield router
    router.close()


def _run(router: Router, tokens: list[int]) -> tuple[int, int]:
    """(predicted, reported) cached tokens of a request of ``tokens``."""
    router.run(tokens, tier=True)
    reported, predictions = router.records[-1]
    return predictions[True], reported


def _empty_local_prefix_cache(router: Router) -> None:
    assert router.scheduler.reset_prefix_cache()
    router.step()


@pytest.mark.parametrize(
    "num_tokens,num_tier_tokens", [(64, 48), (65, 64), (96, 80), (100, 96)]
)
def test_index_predicts_the_cpu_tier_hit_of_a_mamba_hybrid(
    router: Router, num_tokens: int, num_tier_tokens: int
):
    """A prompt offloaded, then served by the CPU tier: the index predicts
    the tokens the scheduler reports, the last block boundary before the last
    token (48 of 64, 64 of 65, 80 of 96, 96 of 100)."""
    tokens = [1000 + 7 * i for i in range(num_tokens)]
    assert _run(router, tokens) == (0, 0)
    _empty_local_prefix_cache(router)
    router.drain()
    assert router.subscriber.indexes[True].predict(tokens) == 0
    predicted, reported = _run(router, tokens)
    assert reported == num_tier_tokens
    assert predicted == reported


def test_index_predicts_every_hit_with_shared_prefixes(router: Router):
    """Prompts of whole blocks and not, sharing prefixes, the local prefix
    cache emptied before every other one: every hit is predicted, some of
    them served by the CPU tier."""
    prefixes = [[2000 + 5 * i + p for i in range(n)] for p, n in enumerate((96, 130))]
    for i, (prefix, cut, extra) in enumerate(
        [(0, 0, 0), (0, 0, 0), (1, 2, 0), (1, 2, 16), (0, 32, 1), (1, 0, 14)] * 2
    ):
        if i % 2:
            _empty_local_prefix_cache(router)
        tokens = prefixes[prefix][: len(prefixes[prefix]) - cut]
        tokens += [9000 + 100 * i + j for j in range(extra)]
        predicted, reported = _run(router, tokens)
        assert predicted == reported, (i, len(tokens), predicted, reported)
    assert router.count(True)["tier hits"] >= 3
    assert router.subscriber.gaps == 0
