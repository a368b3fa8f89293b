"""Stage 08: the check that crosses the stages (`cross_machine.py`: the
setups, the rules and the properties).

CI runs a fixed set: the shrunk schedule of each kind the series fixes
(its explicit examples, in the first cell), then the cells of the cross
product that cover every pair of values of two dimensions (`FIXED_SETUPS`,
chosen greedily from `all_setups()`), each a derandomized run of
`FIXED_EXAMPLES` examples of at most `HMASTACK_RANDOM_STEPS` rules, without a
Hypothesis database. `test_coverage`
then asserts that the set exercised every path of `REQUIRED_COVERAGE`.
The schedules at the end are the shrunk scenarios of each kind the machine
found (`test_kind_*`), run with their kind strict: pytest's strict xfail
with the kind as its reason while the series fails it; once a fix is in the
series the schedule passes, XPASS fails the test, and the kind is to be
removed from `EXPECTED_FAILURES` and its test's mark (the machine is then
strict on it).

A long run with fresh seeds: `HMASTACK_RANDOM_EXAMPLES=N` runs every cell of
the cross product (`all_setups()`, 100 cells) with N / 100 examples each
(at least 1), a fresh seed per cell, printed with the cell's examples and
seconds (`-s`); `HMASTACK_RANDOM_STEPS` sets the rules per example (30);
`HMASTACK_CROSS_REPORT=path` writes the run's seeds, examples, seconds and
findings (the kinds met, and each failing cell's message) as JSON, as does
`HMASTACK_CONFORM_SUMMARY` (`hmastack conform --examples N`). A failing cell
prints its shrunk rules and a reproduction blob; `HMASTACK_RANDOM_NO_SHRINK=1`
stops at the first failing schedule. `HMASTACK_CROSS_STRICT=1` makes every
kind strict.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time

import pytest
from cross_machine import (
    COVERAGE,
    EXPECTED_FAILURES,
    FIXED_KINDS,
    KNOWN_FIRST,
    KNOWN_SEEN,
    CrossSetup,
    all_setups,
    machine_for,
    strict,
)
from hmastack_testkit.kvtest import hypothesis_settings
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

FIXED_EXAMPLES = 25
_RANDOM_EXAMPLES = int(os.environ.get("HMASTACK_RANDOM_EXAMPLES", "0"))
_STEPS = int(os.environ.get("HMASTACK_RANDOM_STEPS", "30"))
_NO_SHRINK = bool(os.environ.get("HMASTACK_RANDOM_NO_SHRINK"))


def _dimensions(setup: CrossSetup) -> tuple:
    connector = setup.connector + (f"-{setup.manager}" if setup.offloads else "")
    return (connector, setup.layout, setup.eagle, setup.scheduling)


def _pairs(setup: CrossSetup) -> set:
    dims = _dimensions(setup)
    return {
        ((i, dims[i]), (j, dims[j]))
        for i, j in itertools.combinations(range(len(dims)), 2)
    }


def pairwise_setups() -> list[CrossSetup]:
    """Cells of the cross product such that every pair of values of two
    dimensions that some cell has is in one of them (greedy: the cell that
    covers most uncovered pairs first, in `all_setups()` order on ties)."""
    cells = all_setups()
    uncovered = set().union(*map(_pairs, cells))
    chosen = []
    while uncovered:
        best = max(cells, key=lambda c: len(_pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


FIXED_SETUPS = pairwise_setups()

if _RANDOM_EXAMPLES:
    SETUPS = all_setups()
    EXAMPLES = max(1, -(-_RANDOM_EXAMPLES // len(SETUPS)))
    SETTINGS = settings(
        hypothesis_settings(EXAMPLES),
        derandomize=False,
        stateful_step_count=_STEPS,
        print_blob=True,
    )
else:
    SETUPS = FIXED_SETUPS
    EXAMPLES = FIXED_EXAMPLES
    SETTINGS = settings(hypothesis_settings(EXAMPLES), stateful_step_count=_STEPS)
if _NO_SHRINK:
    SETTINGS = settings(SETTINGS, phases=[Phase.explicit, Phase.generate])

# The long run's record: one entry per cell.
RUN: list[dict] = []


def run_fixed_kind_schedules() -> None:
    """The shrunk schedule of every kind the series fixes (`FIXED_KINDS`:
    the `test_kind_*` tests without an xfail mark), each with its kind
    strict: the machine's explicit examples, run before the random ones of
    the fixed set (the random examples of a CI-sized set need not meet each
    kind's scenario again)."""
    for name, test in sorted(globals().items()):
        found = re.match(r"test_kind_(\d+)_", name)
        if found and int(found.group(1)) in FIXED_KINDS:
            test()


@pytest.mark.parametrize("setup", SETUPS, ids=CrossSetup.label)
def test_cross_stage_machine(setup: CrossSetup):
    if not _RANDOM_EXAMPLES and setup == SETUPS[0]:
        run_fixed_kind_schedules()
    machine = machine_for(setup)
    seed = None
    if _RANDOM_EXAMPLES:
        seed = int.from_bytes(os.urandom(8), "big")
        machine._hypothesis_internal_use_seed = seed
    known = dict(KNOWN_SEEN)
    before = COVERAGE["example"]
    start = time.monotonic()
    entry = dict(cell=setup.label(), seed=seed, examples=0, seconds=0.0)
    try:
        run_state_machine_as_test(machine, settings=SETTINGS)
    except BaseException as exc:
        entry["failure"] = str(exc).splitlines()[0][:500]
        raise
    finally:
        entry["examples"] = COVERAGE["example"] - before
        entry["seconds"] = round(time.monotonic() - start, 1)
        entry["known"] = {
            str(k): v - known.get(k, 0)
            for k, v in KNOWN_SEEN.items()
            if v > known.get(k, 0)
        }
        RUN.append(entry)
        if _RANDOM_EXAMPLES:
            print(
                f"\n{setup.label()}: seed {seed}, {entry['examples']} examples, "
                f"{entry['seconds']} s, known kinds {entry['known']}"
            )


# The paths the fixed set must exercise: without one of them, the properties
# of that path are not checked in CI.
REQUIRED_COVERAGE = (
    "scheduled with a step in flight",
    "drafts scheduled",
    "local prefix cache hit",
    "connector tier hit",
    "loadable offloading hit",
    "loadable NIXL read",
    "offloading store finished",
    "offloading load finished",
    "offloading load failed",
    "NIXL read finished",
    "NIXL read failed",
    "load failure reported",
    "finished_sending reported",
    "KV transfer params given",
    "request forwarded to the consumer",
    "producer request expired",
    "prompt sent again",
    "prompt sent again after its tier stored it",
    "prefix cache reset",
    "events of the CPU tier",
    "several blocks of a request freed at once",
    "held blocks released together",
    "abort",
)


def test_coverage():
    """The fixed set covered every pair of values of two dimensions and
    exercised every path of REQUIRED_COVERAGE (it runs before this test, in
    file order; -s prints the counts)."""
    print(dict(COVERAGE))
    if _RANDOM_EXAMPLES or len(RUN) < len(FIXED_SETUPS):
        pytest.skip(f"the fixed set did not run in this process ({len(RUN)} cells)")
    assert not set().union(*map(_pairs, all_setups())) - set().union(
        *map(_pairs, FIXED_SETUPS)
    )
    missing = [what for what in REQUIRED_COVERAGE if not COVERAGE[what]]
    assert not missing, f"the fixed set never exercised {missing}"


def test_run_report():
    """The run's record (seeds, examples, seconds, the kinds met, failures)
    to HMASTACK_CROSS_REPORT and HMASTACK_CONFORM_SUMMARY, if set."""
    report = dict(
        examples=sum(e["examples"] for e in RUN),
        seconds=round(sum(e["seconds"] for e in RUN), 1),
        cells=RUN,
        known={str(k): v for k, v in KNOWN_SEEN.items()},
        known_first={str(k): v for k, v in KNOWN_FIRST.items()},
        failures=[e for e in RUN if "failure" in e],
    )
    print(
        f"\n{len(RUN)} cells, {report['examples']} examples, {report['seconds']} s, "
        f"known kinds {report['known']}, {len(report['failures'])} failing cells"
    )
    for var in ("HMASTACK_CROSS_REPORT", "HMASTACK_CONFORM_SUMMARY"):
        path = os.environ.get(var)
        if path:
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    if not RUN:
        pytest.skip("the machine did not run in this process")


# -- the kinds' shrunk schedules ------------------------------------------------


def req(**kwargs) -> dict:
    """The arguments of a request as the rules draw them (`request_args`):
    a one-token prompt of no shared prefix, one token to generate, to the
    first engine, not through the P/D pair, unless `kwargs` says otherwise."""
    return dict(prefix=0, num_own=1, max_tokens=1, pd=False, engine=0) | kwargs


def size(**kwargs) -> dict:
    """The sizes an example draws (`sizes`): the smallest, unless `kwargs`
    says otherwise."""
    return (
        dict(
            window=32,
            num_blocks=24,
            num_cpu_blocks=16,
            max_num_batched_tokens=64,
            fail_policy="recompute",
        )
        | kwargs
    )


def start(cell: CrossSetup, sizes: dict, first: list[dict]):
    """A machine of `cell`, started as the schedule's first rule did."""
    state = machine_for(cell)()
    state.start(cell=cell, size=sizes, first=first)
    state.safety()
    return state


def expect_kind(kind: int, schedule) -> None:
    """Run `schedule` with `kind` strict: a violation of that kind fails the
    test as itself (a kind the series fixes: the test's failure; a kind it
    still has: the strict xfail's expected failure); any other violation is
    another failure."""
    with strict(kind):
        try:
            schedule()
        except AssertionError as exc:
            if f"(kind {kind}," in str(exc):
                raise
            raise RuntimeError(f"not kind {kind}: {exc}") from exc


def xfail_kind(kind: int):
    return pytest.mark.xfail(
        strict=True,
        raises=AssertionError,
        reason=f"kind {kind}: {EXPECTED_FAILURES[kind]}",
    )


def test_kind_1_offloading_claims_a_block_the_cpu_tier_evicted():
    """OffloadingConnector over ARC (32 CPU blocks), full attention + sliding
    window 64, EAGLE: prompts that share prefixes are computed and stored,
    the CPU tier evicts; a 145-token prompt is then a CPU hit of its first 7
    blocks (112 tokens) with none of it cached on the GPU. The lookup checks the
    sliding window blocks the window of token 112 reads (blocks 3~6); with
    EAGLE the scheduler allocates the window of the hit a later request
    takes (token 96: blocks 2~6), and ARC evicted block 2 (LoadableHit;
    without the check, `schedule()` raises in ARC's `prepare_load`)."""

    def schedule():
        state = start(
            CrossSetup("offload", "arc", "full_sw", True, "sync"),
            size(window=64, num_blocks=48, num_cpu_blocks=32),
            [
                req(prefix=1, num_own=76),
                req(prefix=2, num_own=62, max_tokens=12),
                req(prefix=1, num_own=21, max_tokens=8),
            ],
        )
        state.add_request(args=req(num_own=65, max_tokens=4))
        state.steps(accept=0, engine=0, eos_pick=1, num_steps=5)
        state.tier_round_trip(chunks=0, engine=0, num_fillers=0, prefix=3, tail=1)
        state.add_request(args=req(num_own=51, max_tokens=4))
        state.add_request(args=req(prefix=3, num_own=78))
        state.tier_round_trip(chunks=0, engine=0, num_fillers=2, prefix=3, tail=58)
        state.safety()

    expect_kind(1, schedule)


def test_kind_2_consumer_with_eagle_reads_a_block_the_producer_dropped():
    """P/D (NixlConnector), full attention + sliding window 32, EAGLE on
    both sides: the producer prefills 65 tokens in two chunks, the second
    one token at position 64; it frees the sliding window blocks before the
    window of token 64 (blocks 0 and 1). The consumer's table for the
    loaded prompt starts at the window of EAGLE's hit (48: block 1), so its
    block 1 pairs with the producer's null block: the read is unreadable,
    every block a failed load, all 65 tokens computed again (LoadableHit)."""

    def schedule():
        state = start(
            CrossSetup("nixl", "lru", "full_sw", True, "sync"), size(), [req()]
        )
        state.pd_round_trip(
            chunks=1, max_tokens=1, num_steps=1, prefix=0, read="finish", tail=1
        )
        state.safety()

    expect_kind(2, schedule)


def test_kind_3_cpu_tier_events_name_no_group():
    """OffloadingConnector, one full attention group: a 16-token prompt is
    stored to the CPU tier; its BlockStored event (medium CPU) names no KV
    cache group, and its block hash is the raw bytes of the offloading key,
    where the engine's events give an int (EventsNameBlockAndGroup)."""

    def schedule():
        state = start(
            CrossSetup("offload", "lru", "full", False, "sync"), size(), [req()]
        )
        state.tier_round_trip(chunks=0, engine=0, num_fillers=0, prefix=0, tail=16)
        state.safety()

    expect_kind(3, schedule)


def test_kind_4_router_rule_ignores_eagle():
    """EAGLE, full attention + sliding window: a 17-token prompt sent twice
    at once. The first caches block 0 as the second is looked up; with
    EAGLE the engine hits 0 (the block after a hit is computed again and
    must end before the last token), and so does the rule stage 08
    publishes, told by the events that the engine runs EAGLE (`use_eagle`).
    A router that knows the KV cache groups from the engine's configuration
    before their first event, and takes `use_eagle` only from the event
    that names a group first, predicts 16 tokens (RouterPredictsHit)."""

    def schedule():
        state = start(
            CrossSetup("offload", "lru", "full_sw", True, "sync"),
            size(),
            [req(num_own=17)],
        )
        state.resend(args=req(), pick=0)
        state.steps(accept=0, engine=0, eos_pick=None, num_steps=1)
        state.safety()

    expect_kind(4, schedule)


def test_kind_5_held_blocks_freed_in_table_order():
    """OffloadingConnector, full attention + sliding window 32: a 63-token
    prompt slides two blocks out of its window while their stores still
    read them (held); once the stores are reported, the two go back to the
    free queue block 0 first: an immediate free gives block 1 first, so
    that the prefix is evicted last (EvictionOrder)."""

    def schedule():
        state = start(
            CrossSetup("offload", "lru", "full_sw", False, "sync"),
            size(),
            [req(), req(num_own=63, max_tokens=2)],
        )
        state.tier_round_trip(chunks=0, engine=0, num_fillers=0, prefix=0, tail=1)
        state.safety()

    expect_kind(5, schedule)


def test_kind_7_pd_one_group_eagle_reads_one_block_off():
    """P/D, one full attention group, EAGLE: the producer prefills 79 tokens
    in two chunks; the second allocates EAGLE's lookahead slots, so its
    table holds 6 blocks for a 5-block prompt, all in remote_block_ids. The
    consumer reads its 5 blocks from the tail of that list: each gets the
    producer's next block (LoadableHit: the KV of other positions, read
    without an error)."""

    def schedule():
        state = start(CrossSetup("nixl", "lru", "full", True, "sync"), size(), [req()])
        state.pd_round_trip(
            chunks=1, max_tokens=1, num_steps=1, prefix=0, read="finish", tail=15
        )
        state.safety()

    expect_kind(7, schedule)


def test_kind_8_multi_connector_keeps_blocks_no_store_reads():
    """MultiConnector(NixlConnector, OffloadingConnector) on a P/D producer,
    full attention + sliding window 32: a 65-token prompt with
    do_remote_decode is prefilled in two chunks; the first one's store reads
    its 8 blocks, the second slides the window past 2 of them, which are held
    for the store. The request finishes: NIXL delays its free (for the
    consumer), and so does OffloadingConnector (its store runs). The store
    finishes; the worker-side MultiConnector reports the request as
    OffloadingConnector's, whose scheduler side forgets the store; the
    scheduler-side MultiConnector keeps the report from the scheduler while
    NIXL's send runs, so the scheduler does not ask again about the 2 held
    blocks: they stay held with no store reading them (LiveRecords) until the
    consumer read the request or the producer's timeout."""

    def schedule():
        state = start(
            CrossSetup("multi", "lru", "full_sw", False, "sync"),
            size(),
            [req(prefix=1, num_own=33, pd=True)],
        )
        state.pd_round_trip(
            chunks=0, max_tokens=1, num_steps=1, prefix=0, read="finish", tail=1
        )
        state.safety()
        state.tier_round_trip(chunks=0, engine=0, num_fillers=0, prefix=0, tail=1)
        state.safety()

    expect_kind(8, schedule)


def test_kind_9_arc_refused_store_evicts_without_events():
    """OffloadingConnector over ARC with a CPU tier of 16 blocks: a store
    that needs more blocks than ARC can free evicts some, then is refused
    (`prepare_store` returns None) without a BlockRemoved event for them: a
    router's index of the CPU tier still has them (TierEventsExact)."""

    def schedule():
        state = start(
            CrossSetup("offload", "arc", "full", False, "sync"),
            size(),
            [req(), req(prefix=3, num_own=66, max_tokens=12, engine=1)],
        )
        state.tier_round_trip(chunks=1, engine=0, num_fillers=1, prefix=0, tail=1)
        state.safety()

    expect_kind(9, schedule)


def test_kind_10_offloading_needs_the_last_block_of_a_chunk_boundary_hit():
    """P/D producer with MultiConnector(NixlConnector, OffloadingConnector
    over ARC, 16 CPU blocks), full attention + chunked local attention of 32
    tokens, asynchronous scheduling: after P/D round trips and tier round
    trips of prompts that share prefixes, an 81-token prompt computes 48
    tokens locally. The CPU tier holds the full attention group's block 3
    and not the chunked local attention group's: a hit of 64 tokens ends at
    a chunk boundary, where the chunked group's table holds the null block
    for block 3, so the tier serves 16 tokens; OffloadingConnector's lookup
    requires the last block of a hit in every group and claims none
    (RouterPredictsHit)."""

    def schedule():
        state = start(
            CrossSetup("multi", "arc", "full_chunked", False, "async"),
            size(num_blocks=48, max_num_batched_tokens=128),
            [
                req(prefix=3, num_own=4, pd=True),
                req(num_own=89, max_tokens=11),
            ],
        )
        state.finish_all_transfers()
        state.add_request(args=req(prefix=3, num_own=74))
        state.pd_round_trip(
            chunks=0, max_tokens=9, num_steps=3, prefix=0, read="finish", tail=1
        )
        state.add_request(args=req(prefix=1, num_own=44, max_tokens=9))
        state.add_request(args=req(num_own=61, max_tokens=11, pd=True))
        state.tier_round_trip(chunks=0, engine=1, num_fillers=0, prefix=0, tail=1)
        state.finish_all_transfers()
        state.pd_round_trip(
            chunks=0, max_tokens=4, num_steps=2, prefix=0, read="finish", tail=1
        )
        state.add_request(args=req(num_own=5, max_tokens=4, pd=True))
        state.finish_all_transfers()
        state.tier_round_trip(chunks=0, engine=0, num_fillers=1, prefix=2, tail=19)
        state.safety()

    expect_kind(10, schedule)


def test_kind_11_producer_stops_holding_blocks_no_consumer_reads():
    """P/D (NixlConnector), full attention + sliding window 64, batch queue,
    32 blocks: a 97-token prompt with do_remote_decode waits for its
    consumer; a 145-token one is preempted in its prefill (93 tokens
    computed) when the pool runs short, and the producer holds the two
    blocks of its sliding window table that a consumer reads (positions 4
    and 5). The first request expires; the second resumes with a prefix
    cache hit of 144 tokens, whose window puts real blocks in its table at
    positions 4 and 5 again (block 29 itself, and another one), and
    finishes: the producer offers its table's blocks there and no longer
    reads the two it held. Aborted while preempted instead, no consumer
    reads them either. Either way the scheduler kept them held, read by
    nobody, until the worker side reported the request (the consumer's read
    or the expiry; LiveRecords)."""

    def first_steps():
        state = start(
            CrossSetup("nixl", "lru", "full_sw", False, "batch_queue"),
            size(window=64, num_blocks=32),
            [req(), req(), req(prefix=1, num_own=65, pd=True)],
        )
        state.pd_round_trip(
            chunks=0, max_tokens=1, num_steps=1, prefix=3, read="finish", tail=1
        )
        state.safety()
        return state

    def resumed():
        state = first_steps()
        state.expire(pick=0)
        state.safety()
        state.steps(accept=0, engine=0, eos_pick=None, num_steps=5)
        state.safety()

    def aborted():
        state = first_steps()
        state.abort(pick=0)
        state.safety()

    expect_kind(11, resumed)
    expect_kind(11, aborted)
