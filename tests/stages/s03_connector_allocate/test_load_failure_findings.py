"""Stage 03: the model's counterexamples for load failures, through vLLM's Scheduler.

The models of stage 03 (``series-stale-read-abort``: as on main, ``Policy =
"SeriesMain"``; ``series-stale-read-preempt``: the twelve commits,
``"SeriesAsCoded"``, the defect is still there) violate
``NoStaleRead`` (no request reads KV that a failed load left invalid, unless
another holder recomputes it first). TLC's two counterexamples are committed
under ``fixtures/counterexamples/`` (``hmastack spec traces MODEL
--counterexample``; ``tests/unit/test_counterexample_fixtures.py`` checks them
against a fresh TLC run) and replayed here step by step through the
``Scheduler`` with the scheduler replay's harness, every state compared. At
the end the test asserts the property on vLLM's own state: these tests fail on
the code as it is (strict xfail) and pass once it is fixed.

* ``series-stale-read-abort``: a synchronous load fails at block 0; the request
  will recompute the block in place (policy "recompute"), so
  ``_handle_invalid_blocks`` leaves the published invalid block in the prefix
  cache; the request is aborted first and the next request hits the block.
* ``series-stale-read-preempt``: ``Request.num_cached_tokens`` is set the first
  time a request is scheduled and never reset. A request first scheduled with a
  2-token hit is preempted, comes back with an external token loaded
  synchronously, and that load fails: ``_update_requests_with_invalid_blocks``
  scans only the first ``num_cached_tokens`` of a running request, so the
  failure is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_scheduler_replay import Mismatch, Replay, pc_only
from vllm.v1.request import RequestStatus

CEX = Path(__file__).parent / "fixtures" / "counterexamples"


def load(name: str) -> dict:
    return json.loads((CEX / f"{name}.json").read_text())


def drive(doc: dict, upto: int) -> Replay:
    """Replay states 1..upto of a counterexample (each compared); returns the
    harness with the Scheduler in the last replayed state."""
    states = doc["states"]
    rp = Replay(doc["constants"])
    k = 1
    while k <= upto:
        if pc_only(states[k - 1], states[k]):
            k += 1
            continue
        reached = rp.step(states, k)
        problems = rp.compare(states[reached])
        if problems:
            raise Mismatch(f"{doc['model']} step {k}: " + "; ".join(problems))
        k = reached + 1
    return rp


def invalid_reads(rp: Replay, state: dict) -> list[str]:
    """Requests whose computed tokens cover a block slot that a failed load
    left invalid (the model's ``bad``, as vLLM block ids), with no other
    request holding the block that still has to compute that token."""
    bad = {(rp.m2r[b], o) for b, o in state["bad"] if b in rp.m2r}
    B = rp.B
    found = []
    for r, request in rp.requests.items():
        if request.status not in (RequestStatus.RUNNING, RequestStatus.WAITING):
            continue
        tables = rp.real_tables(r)
        for g, table in tables.items():
            for p in range(request.num_computed_tokens):
                i = p // B
                if i >= len(table) or table[i] == 0 or (table[i], p % B) not in bad:
                    continue
                recomputes = [
                    q
                    for q, other in rp.requests.items()
                    if q != r
                    and other.status in (RequestStatus.RUNNING, RequestStatus.WAITING)
                    and i < len(rp.real_tables(q)[g])
                    and rp.real_tables(q)[g][i] == table[i]
                    and other.num_computed_tokens <= p
                ]
                if not recomputes:
                    found.append(
                        f"{r} counts token {p} as computed; its {g} block "
                        f"{table[i]} holds KV a failed load left invalid"
                    )
    return found


@pytest.mark.xfail(
    strict=True,
    reason="stage 03 keeps a block whose sync load failed in the prefix cache "
    "when the failing request is to recompute it (policy 'recompute'); if that "
    "request leaves first, the next hit reads invalid KV. The fix (every holder "
    "recomputes; invalid blocks leave the prefix cache) belongs to the stage-03 "
    "failure-paths work (issue 16, kind 1).",
)
def test_invalid_block_leaves_the_prefix_cache_when_its_recompute_is_aborted():
    doc = load("series-stale-read-abort")
    rp = drive(doc, len(doc["states"]) - 1)
    assert invalid_reads(rp, doc["states"][-1]) == []


def test_stale_read_abort_trace_reaches_the_hit():
    """The counterexample itself (a regular check): replayed through the
    Scheduler, the second request does hit the invalid block."""
    doc = load("series-stale-read-abort")
    rp = drive(doc, len(doc["states"]) - 1)
    last = doc["states"][-1]["event"]
    assert last["act"] == "AllocateSlots" and last["args"]["hit"] == 1
    assert invalid_reads(rp, doc["states"][-1]), "the replay shows the stale read"


@pytest.mark.xfail(
    strict=True,
    reason="Request.num_cached_tokens is not reset on preemption, and "
    "_update_requests_with_invalid_blocks scans only that many tokens of a "
    "running request: a failed synchronous load after a preemption is ignored. "
    "The fix belongs to the stage-03 failure-paths work (issue 16).",
)
def test_sync_load_failure_after_preemption_is_handled():
    doc = load("series-stale-read-preempt")
    states = doc["states"]
    fail = len(states) - 1
    ev = states[fail]["event"]
    assert ev["act"] == "SyncLoadFailed" and ev["args"]["affected"] == []
    rp = drive(doc, fail - 1)
    r, before = ev["req"], states[fail - 1]
    request = rp.requests[r]
    # The step returns with the failed load's blocks reported invalid.
    out = rp.inflight.pop(r)
    sampled = before["step"][r]["from"] + before["step"][r]["n"] == before["len"][r]
    tokens = [7000 + request.num_tokens] if sampled else []
    rp.sched.update_from_output(
        out,
        rp.runner_output({r: tokens}, invalid_block_ids=rp.invalid_blocks(before, ev)),
    )
    # The request must not count the tokens of the invalid blocks as computed.
    first_invalid_token = (ev["args"]["at"] - 1) * rp.B
    assert request.num_computed_tokens <= first_invalid_token, (
        f"{r}: num_computed_tokens {request.num_computed_tokens} after a load "
        f"that failed from token {first_invalid_token} "
        f"(num_cached_tokens {request.num_cached_tokens})"
    )
