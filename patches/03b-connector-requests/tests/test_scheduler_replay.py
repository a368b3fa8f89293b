"""Stage 03: behaviours of the model (Series) replayed through vLLM's Scheduler.

Each behaviour (``fixtures/replay/trace-*.json``, or every ``trace-*.json``
of the directory named by ``HMASTACK_REPLAY_TRACES``) is one test, replayed
by the harness of ``scheduler_replay.py`` (``Replay``), which compares the
scheduler's state with the model's after every step; the summary (run last)
counts the steps compared and why traces stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hmastack_testkit import traces
from scheduler_replay import (
    FIXTURES,
    RESULTS,
    TRACES_ENV,
    replay_all,
    replay_trace,
    trace_paths,
)

TRACES = trace_paths()


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_scheduler_replay(path):
    RESULTS[path] = replay_trace(path)


def unaligned_async_loads(paths: list[Path]) -> list[tuple[Path, int]]:
    """(trace, step) of each FinishLoad of an async load ending inside a block."""
    found = []
    for path in paths:
        doc = traces.read(path)
        states, block_size = doc.states, doc.constants["B"]
        for k in range(1, len(states)):
            ev = states[k]["event"]
            r = ev["req"]
            if (
                ev["act"] == "FinishLoad"
                and states[k - 1]["status"][r] == "loading"
                and states[k]["computed"][r] % block_size != 0
            ):
                found.append((path, k))
    return found


def test_async_load_ending_inside_a_block_counts_only_loaded_tokens():
    """Found by this replay (first fixtures: trace-0002, step 5, ``FinishLoad``).

    A request whose asynchronous load ends inside a block (1 external token,
    B = 2): 0.13.0's ``_update_waiting_for_remote_kv`` took the block tables'
    tokens as computed (2) and published a block whose second token was never
    loaded. The model counts hit + external tokens and publishes nothing;
    stage 03 resumes the request after its loaded tokens. Every fixture with
    such a load must be replayed past it with the states equal.
    """
    cases = unaligned_async_loads(TRACES)
    assert cases, "the fixtures hold an async load ending inside a block"
    for path, k in cases:
        res = replay_trace(path)
        assert res.stop is None or res.stop[1] > k, res.stop
        assert res.diverged is None or int(res.diverged.split()[1].rstrip(":")) > k
        assert res.steps >= k


def test_scheduler_replay_summary():
    """The traces exist and most of their steps were compared (run last)."""
    assert TRACES, f"no trace-*.json in {os.environ.get(TRACES_ENV) or FIXTURES}"
    if (TRACES[0].parent / "index.json").exists():
        assert len(traces.read_index(TRACES[0].parent).traces) == len(TRACES)
    summary = replay_all(TRACES)
    print("\n" + summary.format())
    if os.environ.get("HMASTACK_CONFORM_SUMMARY"):  # read by hmastack conform
        Path(os.environ["HMASTACK_CONFORM_SUMMARY"]).write_text(
            json.dumps(
                {
                    "traces": summary.traces,
                    "to_the_end": summary.complete,
                    "steps_compared": summary.steps,
                    "steps": summary.events,
                    "diverged": len(summary.diverged),
                    "stopped_by_event": dict(summary.stops),
                }
            )
        )
    assert summary.steps * 2 >= summary.events, "fewer than half the steps compared"
