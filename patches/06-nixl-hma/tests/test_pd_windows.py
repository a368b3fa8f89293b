"""Stage 06: P/D with NixlConnector when the two sides keep different windows,
checked on two real `Scheduler`s (a producer and a consumer, each with
NixlConnector's scheduler side).

Hypothesis draws a P/D round trip: a KV cache layout (full attention + a
sliding window of 32, 40, 48 or 64 tokens, + two sliding window groups,
+ chunked local attention of 32 or 64 tokens, or full attention alone), a
prompt, the producer's token budget per step (its prefill chunks), eagle on
the producer and on the consumer, a prefix of the prompt that each side
computed before (its own prefix cache hit), and a preemption of the
producer during its prefill. The producer prefills the prompt and offers its
blocks (`kv_transfer_params`); the consumer schedules the request with them.

Properties, checked on every round trip:
- `ClaimLoadable`: every block the consumer's scheduler allocates for the
  external tokens it claims is paired with a real block of the producer at
  the same position of the same group (one group: the last remote blocks,
  as the worker pairs them), still allocated there, which held that
  position of the producer's tables: no block of the claim is a failed
  load (eagle on or off).
- `WholePromptLoaded`: a producer that computed the prompt itself (no
  prefix cache hit of its own) serves it whole: the consumer claims every
  token after its own prefix cache hit.
- `ProducerReleases`: once the consumer's read is reported, the producer
  holds no block any more (none held for the consumer is left).

vLLM's CPU engine cannot run speculative decoding, so eagle meets
NixlConnector here and in vLLM's worker-level tests (real NIXL agents over
UCX), not in the end-to-end runs.

CI runs a fixed, derandomized set with the explicit examples below (the
reported case among them); `HMASTACK_RANDOM_EXAMPLES=N` runs N random
examples; `HMASTACK_RANDOM_NO_SHRINK=1` stops at the first failure, as
`hmastack conform` does on broken trees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hmastack_testkit.kvtest import (
    example_settings,
    make_cpu_vllm_config,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    model_runner_output,
)
from hypothesis import event, example, given
from hypothesis import strategies as st
from vllm.config import KVTransferConfig, SpeculativeConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

BLOCK_SIZE = 16
NUM_BLOCKS = 160
NULL_BLOCK_ID = 0
LAYOUTS = {
    "full+sliding_window": ["full", "sliding_window"],
    "full+2 sliding_window": ["full", "sliding_window", "sliding_window"],
    "full+chunked_local": ["full", "chunked_local"],
    "full": ["full"],
}
WINDOWS = {"sliding_window": (32, 40, 48, 64), "chunked_local": (32, 64)}

SETTINGS = example_settings(60)


@dataclass(frozen=True)
class RoundTrip:
    layout: str
    window: int
    num_tokens: int
    budget: int  # the producer's tokens per step
    producer_eagle: bool
    consumer_eagle: bool
    producer_prefix: int  # tokens of the prompt the producer computed before
    consumer_prefix: int
    preempt_after: int  # the producer's chunks before a preemption; 0: none


@st.composite
def round_trips(draw) -> RoundTrip:
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    windowed = [k for k in LAYOUTS[layout] if k in WINDOWS]
    window = draw(st.sampled_from(WINDOWS[windowed[0]])) if windowed else 32
    # Prompts around block boundaries, where eagle's block and the last
    # chunk's window part.
    num_tokens = draw(
        st.one_of(
            st.integers(1, 200),
            st.builds(
                lambda k, r: BLOCK_SIZE * k + r,
                st.integers(1, 11),
                st.sampled_from([0, 1, 2, BLOCK_SIZE - 1]),
            ),
        )
    )
    budget = draw(
        st.one_of(
            st.integers(8, 256),
            # The last chunk of one or two tokens.
            st.builds(
                lambda last: max(8, (num_tokens - last) // 2 or 8),
                st.sampled_from([1, 2]),
            ),
        )
    )
    prefix = st.one_of(st.just(0), st.just(num_tokens), st.integers(0, num_tokens))
    return RoundTrip(
        layout=layout,
        window=window,
        num_tokens=num_tokens,
        budget=budget,
        producer_eagle=draw(st.booleans()),
        consumer_eagle=draw(st.booleans()),
        producer_prefix=draw(prefix),
        consumer_prefix=draw(prefix),
        preempt_after=draw(st.integers(0, 3)),
    )


def _scheduler(trip: RoundTrip, eagle: bool, budget: int):
    vllm_config = make_cpu_vllm_config(
        BLOCK_SIZE,
        NUM_BLOCKS,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=2048,
    )
    if eagle:
        speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
        # The scheduler only asks use_eagle(); an eagle draft model cannot be
        # built here.
        object.__setattr__(speculative_config, "method", "eagle")
        vllm_config.speculative_config = speculative_config
    kv_cache_config = make_kv_cache_config(
        LAYOUTS[trip.layout], BLOCK_SIZE, trip.window, NUM_BLOCKS
    )
    scheduler = make_scheduler(vllm_config, kv_cache_config)
    assert scheduler.use_eagle == eagle
    return scheduler


def _output(requests, finished_sending=None, sample=True) -> ModelRunnerOutput:
    req_ids = [r.request_id for r in requests]
    return model_runner_output(
        req_ids,
        [[7] if sample else [] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(finished_sending=finished_sending)
        if finished_sending
        else None,
    )


def _run(scheduler, request, tables_seen=None, preempt_after=0) -> dict | None:
    """Run `request` on `scheduler` to its end (a partial prefill samples no
    token), preempting it once after `preempt_after` steps; the blocks of its
    tables at each position after every step go into `tables_seen`. Returns
    the kv_transfer_params of its output."""
    scheduler.add_request(request)
    steps = 0
    while True:
        out = scheduler.schedule()
        if tables_seen is not None:
            for group, table in enumerate(
                scheduler.kv_cache_manager.get_block_ids(request.request_id)
            ):
                for pos, block_id in enumerate(table):
                    tables_seen.setdefault((group, pos), set()).add(block_id)
        prefilling = request.num_computed_tokens < request.num_prompt_tokens
        outputs = scheduler.update_from_output(
            out, _output([request], sample=not prefilling)
        )
        steps += 1
        if request.is_finished():
            (output,) = outputs[0].outputs
            return output.kv_transfer_params
        if steps == preempt_after and prefilling:
            # What the scheduler does when it preempts a request in its step.
            scheduler.running.remove(request)
            scheduler._preempt_request(request, time.monotonic())
            scheduler.prev_step_scheduled_req_ids.discard(request.request_id)


def _prompt(num_tokens: int) -> list[int]:
    return [1000 + 7 * i for i in range(num_tokens)]


def round_trip(trip: RoundTrip) -> tuple[int, int, bool]:
    """One P/D round trip, its properties checked; returns the tokens the
    consumer claimed, its own prefix cache hit and whether the producer held
    blocks for it past its tables."""
    prompt = _prompt(trip.num_tokens)
    producer = _scheduler(trip, trip.producer_eagle, trip.budget)
    if trip.producer_prefix:
        _run(
            producer,
            make_request(
                "producer-prefix", prompt[: trip.producer_prefix], BLOCK_SIZE, 1
            ),
        )
    request = make_request("pd", prompt, BLOCK_SIZE, max_tokens=1)
    request.kv_transfer_params = dict(do_remote_prefill=False, do_remote_decode=True)
    tables_seen: dict[tuple[int, int], set[int]] = {}
    params = _run(producer, request, tables_seen, trip.preempt_after)
    held = bool(producer.kv_cache_manager.held_blocks.get("pd"))
    assert params is not None and params["do_remote_prefill"]
    remote = params["remote_block_ids"]
    one_group = len(LAYOUTS[trip.layout]) == 1
    remote_tables = [remote] if one_group else remote
    producer_pool = producer.kv_cache_manager.block_pool

    consumer = _scheduler(trip, trip.consumer_eagle, 4096)
    if trip.consumer_prefix:
        _run(
            consumer,
            make_request(
                "consumer-prefix", prompt[: trip.consumer_prefix], BLOCK_SIZE, 1
            ),
        )
    consumer_request = make_request("pd", prompt, BLOCK_SIZE, max_tokens=4)
    consumer_request.kv_transfer_params = dict(params)
    # The consumer's own prefix cache hit (a lookup changes nothing).
    _, num_hit_tokens = consumer.kv_cache_manager.get_computed_blocks(consumer_request)
    consumer.add_request(consumer_request)
    out = consumer.schedule()
    req_meta = out.kv_connector_metadata.reqs_to_recv.get("pd")
    tables = consumer.kv_cache_manager.get_blocks("pd").blocks
    claimed = consumer_request.num_external_computed_tokens

    # ClaimLoadable
    problems = []
    if claimed:
        assert req_meta is not None
        if req_meta.unreadable or req_meta.local_block_ids_not_read:
            problems.append(
                f"blocks reported as failed loads: "
                f"{req_meta.local_block_ids_not_read or req_meta.local_block_ids}"
            )
        if one_group:
            local = req_meta.local_block_ids
            paired = req_meta.remote.block_ids[
                len(req_meta.remote.block_ids) - len(local) :
            ]
            positions = [p for p, b in enumerate(tables[0]) if b.block_hash is None]
            pairs = [
                (0, p, lb, rb)
                for p, lb, rb in zip(positions, local, paired, strict=False)
            ]
        else:
            pairs = [
                (g, p, lb, rb)
                for g, (locals_, remotes) in enumerate(
                    zip(
                        req_meta.local_block_ids_per_group,
                        req_meta.remote.block_ids_per_group,
                        strict=True,
                    )
                )
                for p, lb, rb in zip(
                    [
                        p
                        for p, b in enumerate(tables[g])
                        if not b.is_null and b.block_hash is None
                    ],
                    locals_,
                    remotes,
                    strict=False,
                )
            ]
        for group, table in enumerate(tables):
            needed = [
                p for p, b in enumerate(table) if not b.is_null and b.block_hash is None
            ]
            read = [p for g, p, _, _ in pairs if g == group]
            if needed != read:
                problems.append(
                    f"group {group}: positions {needed} need KV, {read} read"
                )
        for group, pos, local_id, remote_id in pairs:
            if tables[group][pos].block_id != local_id:
                problems.append(f"group {group} position {pos}: local block mismatch")
            if remote_id != remote_tables[group][pos] or remote_id == NULL_BLOCK_ID:
                problems.append(
                    f"group {group} position {pos}: reads remote block {remote_id}, "
                    f"the producer's table has {remote_tables[group][pos]}"
                )
            elif remote_id not in tables_seen.get((group, pos), ()):
                problems.append(
                    f"group {group} position {pos}: remote block {remote_id} never "
                    "held that position on the producer"
                )
            elif producer_pool.blocks[remote_id].ref_cnt < 1:
                problems.append(
                    f"group {group} position {pos}: remote block {remote_id} is free "
                    "on the producer"
                )
    assert not problems, f"ClaimLoadable violated: {trip}: " + "; ".join(problems)

    # WholePromptLoaded
    if not trip.producer_prefix:
        assert num_hit_tokens + claimed == trip.num_tokens, (
            f"WholePromptLoaded violated: {trip}: the consumer claims {claimed} "
            f"tokens after a hit of {num_hit_tokens} of {trip.num_tokens}"
        )

    # ProducerReleases
    out = producer.schedule()
    producer.update_from_output(out, _output([], finished_sending={"pd"}))
    manager = producer.kv_cache_manager
    left = [
        b.block_id for b in manager.block_pool.blocks if b.ref_cnt > 0 and not b.is_null
    ]
    assert not left and not manager.held_blocks and not producer.requests, (
        f"ProducerReleases violated: {trip}: blocks {left} still allocated, held "
        f"for {sorted(manager.held_blocks)}"
    )
    if claimed:
        assert consumer_request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return claimed, num_hit_tokens, held


REPORTED = RoundTrip(
    # A 112-token prompt prefilled in chunks of 37 (the last is token 111),
    # a consumer with eagle.
    "full+sliding_window",
    32,
    112,
    37,
    False,
    True,
    0,
    0,
    0,
)
# The producer's own prefix cache hit (112 of 113 tokens) starts its window
# after eagle's block: the consumer must claim less, not fail.
PRODUCER_HIT = RoundTrip("full+sliding_window", 32, 113, 256, False, True, 113, 0, 0)
# With eagle, the producer's chunked tables hold a block past the prompt.
ONE_GROUP = RoundTrip("full", 32, 112, 37, True, False, 0, 0, 0)


@SETTINGS
@example(REPORTED)
@example(PRODUCER_HIT)
@example(ONE_GROUP)
@given(round_trips())
def test_pd_random(trip: RoundTrip):
    claimed, hit, held = round_trip(trip)
    # What the examples reach (hypothesis' statistics).
    event(f"producer held blocks: {held}")
    event(f"claim shorter than the prompt: {hit + claimed < trip.num_tokens}")


def test_the_explicit_round_trips_reach_their_cases():
    """The explicit examples reach what they stand for: in the reported case
    the producer holds a block its window dropped and the consumer loads the
    whole prompt; a producer whose own hit starts its window after eagle's
    block serves a shorter claim (here none); one group with eagle on the
    producer loads the whole prompt."""
    assert round_trip(REPORTED) == (112, 0, True)
    claimed, hit, _ = round_trip(PRODUCER_HIT)
    assert hit == 0 and claimed < 113
    assert round_trip(ONE_GROUP)[:2] == (112, 0)
