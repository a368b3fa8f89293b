"""Stage 03: the model's counterexamples for load failures, through vLLM's Scheduler.

Two defects of stage 03's per-group allocation alone that the model found,
each fixed by a patch of stage 03; their counterexamples violate
``NoStaleRead`` (no request reads KV that a failed load left invalid, unless
another holder recomputes it first):

* ``series-stale-read-abort`` (``Policy = "SeriesAllocOnly"``; patch
  [00c.1 All sharers of a failed KV block]): a synchronous load fails at block
  0; the request will recompute the block in place (policy "recompute"), so
  ``_handle_invalid_blocks`` left the published invalid block in the prefix
  cache; the request is aborted first and the next request hits the block.
* ``mutations/range-by-cached`` (``SeriesAsCoded`` with patch
  [00c.3 Handle a failed sync KV load] switched off):
  ``Request.num_cached_tokens`` is set the first time a request is scheduled
  and never reset. A request first scheduled with a 2-token hit is preempted,
  comes back with an external token loaded synchronously, and that load fails:
  a scan of only the first ``num_cached_tokens`` of a running request ignored
  the failure.

TLC's counterexamples are committed under ``fixtures/counterexamples/``
(``hmastack spec traces MODEL --counterexample``;
``tests/unit/test_counterexample_fixtures.py`` checks them against a fresh TLC
run). Each test replays the counterexample through the ``Scheduler`` with the
scheduler replay's harness up to the failing step (every state compared: up
to there the code and the model agree), lets the step return with the failed
load's blocks reported invalid, and asserts the property on vLLM's own state.
They fail on a tree without the fix (vLLM's own unit tests in patches
[00c.1 All sharers of a failed KV block] and [00c.3 Handle a failed sync KV load]
are the witnesses) and pass on stage 03.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from hmastack_testkit import traces
from scheduler_replay import Mismatch, Replay, pc_only
from vllm.v1.request import RequestStatus

CEX = Path(__file__).parent / "fixtures" / "counterexamples"


def load(name: str) -> traces.Trace:
    return traces.read(CEX / f"{name}.json")


def drive(doc: traces.Trace, upto: int) -> Replay:
    """Replay states 1..upto of a counterexample (each compared); returns the
    harness with the Scheduler in the last replayed state."""
    states = doc.states
    rp = Replay(doc.constants)
    k = 1
    while k <= upto:
        if pc_only(states[k - 1], states[k]):
            k += 1
            continue
        reached = rp.step(states, k)
        problems = rp.compare(states[reached])
        if problems:
            raise Mismatch(f"{doc.model} step {k}: " + "; ".join(problems))
        k = reached + 1
    return rp


def failing_step(doc: dict) -> int:
    return next(
        k for k, st in enumerate(doc.states) if st["event"]["act"] == "SyncLoadFailed"
    )


def return_failed_step(rp: Replay, before: dict, ev: dict) -> set[int]:
    """The failing request's step returns with the blocks of its failed load
    (from table slot ``at`` on) reported invalid; returns their vLLM ids."""
    r = ev["req"]
    request = rp.requests[r]
    invalid = rp.invalid_blocks(before, ev)
    out = rp.inflight.pop(r)
    sampled = before["step"][r]["from"] + before["step"][r]["n"] == before["len"][r]
    tokens = [7000 + request.num_tokens] if sampled else []
    rp.sched.update_from_output(
        out, rp.runner_output({r: tokens}, invalid_block_ids=invalid)
    )
    return invalid


def test_invalid_block_leaves_the_prefix_cache_when_its_recompute_is_aborted():
    doc = load("series-stale-read-abort")
    states = doc.states
    fail = failing_step(doc)
    ev, before = states[fail]["event"], states[fail - 1]
    rp = drive(doc, fail - 1)
    invalid = return_failed_step(rp, before, ev)
    assert invalid, "the counterexample's load fails on real blocks"
    r = ev["req"]
    # The model's next steps: the failing request is aborted, the other one
    # looks its prompt up in the prefix cache.
    assert [s["event"]["act"] for s in states[fail + 1 :]] == ["Abort", "AllocateSlots"]
    rp.sched.finish_requests(r, RequestStatus.FINISHED_ABORTED)
    other = states[-1]["event"]["req"]
    hits, num_hit = rp.sched.kv_cache_manager.get_computed_blocks(rp.requests[other])
    hit_ids = {b.block_id for group in hits.blocks for b in group}
    assert not hit_ids & invalid, (
        f"{other} hits blocks {sorted(hit_ids & invalid)} ({num_hit} tokens) whose "
        f"KV a failed load left invalid; {r}, which was to recompute them, is aborted"
    )


def test_stale_read_abort_counterexample_reads_invalid_kv():
    """The counterexample is one (a check of the fixture's meaning): its last
    step hits a block whose slot the failed load left invalid."""
    doc = load("series-stale-read-abort")
    last = doc.states[-1]
    ev = last["event"]
    assert ev["act"] == "AllocateSlots" and ev["args"]["hitBlocks"] == 1
    block = last["table"][ev["req"]]["full"][0]
    assert [block, 0] in last["bad"]


def test_sync_load_failure_after_preemption_is_handled():
    doc = load("mutations/range-by-cached")
    assert doc.constants["Mutation"] == "RangeByCached"
    states = doc.states
    fail = failing_step(doc)
    assert fail == len(states) - 1
    ev, before = states[fail]["event"], states[fail - 1]
    # Without patch [00c.3 Handle a failed sync KV load] the model ignores the
    # failure (nobody is affected).
    assert ev["args"]["affected"] == []
    # Up to the failure the mutation changes nothing: the replay follows the
    # code's model.
    coded = msgspec.structs.replace(
        doc, constants={**doc.constants, "Mutation": "none"}
    )
    rp = drive(coded, fail - 1)
    r = ev["req"]
    request = rp.requests[r]
    return_failed_step(rp, before, ev)
    # The request must not count the tokens of the invalid blocks as computed.
    first_invalid_token = (ev["args"]["atSlot"] - 1) * rp.B
    assert request.num_computed_tokens <= first_invalid_token, (
        f"{r}: num_computed_tokens {request.num_computed_tokens} after a load "
        f"that failed from token {first_invalid_token} "
        f"(num_cached_tokens {request.num_cached_tokens})"
    )
