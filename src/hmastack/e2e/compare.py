"""Judging one scenario at one stage: outputs, cached tokens, engine figures.

Pure functions over the driver's JSON (``hmastack_testkit.e2e.driver``): a run with the
connector against the reference run (no connector, no prefix caching) of the
same stage, model and HMA setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
from hmastack_testkit.window import window_min_blocks

from hmastack.e2e import catalogue as cat
from hmastack.e2e.catalogue import BLOCK_SIZE, LOGPROB_TOLERANCE, WINDOW, At, Scenario


@dataclass
class RequestComparison:
    key: str
    tokens_equal: bool
    topk_equal: bool  # the same top-k token ids at every position
    max_logprob_diff: float  # over the top-k logprobs both runs list
    num_cached_tokens: int | None
    expected_cached: int | None

    @property
    def equal(self) -> bool:
        return (
            self.tokens_equal
            and self.topk_equal
            and self.max_logprob_diff <= LOGPROB_TOLERANCE
        )

    @property
    def cached_ok(self) -> bool:
        return self.expected_cached is None or self.num_cached_tokens == (
            self.expected_cached
        )


def compare_request(ref: dict, got: dict) -> RequestComparison:
    """Compare one request of a connector run (``got``) with the reference.

    Both are ``RequestRecord`` dicts; ``logprobs[i]`` lists ``[token, logprob]``
    pairs of position ``i``. A token id in one top-k and not the other makes
    ``topk_equal`` false; the logprob difference is taken over shared ids.
    """
    diff = 0.0
    if got.get("tokens_only"):
        # a run that returns no logprobs by id (the server smoke test): its
        # tokens are compared, its logprobs are not
        return RequestComparison(
            key=got["key"],
            tokens_equal=list(ref["tokens"]) == list(got["tokens"]),
            topk_equal=True,
            max_logprob_diff=0.0,
            num_cached_tokens=got.get("num_cached_tokens"),
            expected_cached=got.get("expected_cached"),
        )
    topk_equal = len(ref["logprobs"]) == len(got["logprobs"])
    for a, b in zip(ref["logprobs"], got["logprobs"], strict=False):
        da = {int(t): float(lp) for t, lp in a}
        db = {int(t): float(lp) for t, lp in b}
        if set(da) != set(db):
            topk_equal = False
        for t in set(da) & set(db):
            d = abs(da[t] - db[t])
            diff = max(diff, d if not math.isnan(d) else math.inf)
    return RequestComparison(
        key=got["key"],
        tokens_equal=list(ref["tokens"]) == list(got["tokens"]),
        topk_equal=topk_equal,
        max_logprob_diff=diff,
        num_cached_tokens=got.get("num_cached_tokens"),
        expected_cached=got.get("expected_cached"),
    )


def window_bound(new_tokens: int) -> int:
    """Most blocks a sliding-window group needs for a request that computes
    ``new_tokens`` after an external hit: the window before them and the new
    tokens, ``ceil((W - 1 + new) / B) + 1`` (the +1: a window that does not
    start on a block boundary spans one block more)."""
    return window_min_blocks(WINDOW + new_tokens, BLOCK_SIZE)


class Verdict(msgspec.Struct):
    """One scenario at one stage, as the report (build/reports/e2e.json) and the
    site show it."""

    scenario: str
    title: str
    stage: str  # its key ("base", "03")
    hma: bool
    connector: str
    outcome: str  # "equal" | "not equal" | "stall" | "error" | "hang" | "not run"
    # "inf" where a logprob is missing or NaN (JSON has no infinity)
    max_logprob_diff: float | str | None = None
    cached: list[list] = []  # [key, expected, got]
    cached_ok: bool | None = None
    groups: list[str] = []
    peak_blocks: dict[str, list[int]] = {}
    loaded_blocks: dict[str, list[int]] = {}
    null_blocks_skipped: dict[str, list[int]] = {}
    figures: dict = {}
    checks: dict[str, bool] = {}  # check -> passed
    expect: str = "equal"
    passed: bool = False
    caught_by: str | None = None  # negative controls: the check that failed
    detail: str = ""
    seconds: float = 0.0


def judge(
    s: Scenario,
    at: At,
    hma: bool,
    connector: str,
    run: dict | None,
    reference: dict | None,
    scenario_key: str,
    title: str,
) -> Verdict:
    """The verdict of scenario ``s`` at stage ``at`` from the driver outputs of
    the connector run (``run``: the scenario's entry plus ``groups``) and of the
    reference (``reference``: its entry for the same function)."""
    v = Verdict(scenario_key, title, at.key, hma, connector, "not run", expect=s.expect)
    if run is None:
        v.detail = "no output from the engine process"
        return v
    v.groups = list(run.get("groups", []))
    v.seconds = float(run.get("seconds", 0.0))
    outcome = run.get("outcome", "error")
    obs = run.get("observation", {})
    conn = run.get("connector", {})
    v.peak_blocks = dict(obs.get("peak_blocks", {}))
    v.loaded_blocks = dict(conn.get("loaded_blocks_per_group", {}))
    v.null_blocks_skipped = dict(conn.get("null_blocks_skipped_per_group", {}))
    v.figures = {
        "max_running": obs.get("max_running"),
        "preemptions": obs.get("preemptions"),
        "steps": obs.get("steps"),
        "external_tokens": conn.get("external_tokens", {}),
    }
    findings = list(conn.get("findings", []))
    base_bug_shows = cat.base_bug_shows(s, at)
    fixed_at = at.fixed_at.get(scenario_key)
    if outcome in ("stall", "error", "hang", "not run"):
        v.outcome = outcome
        v.detail = str(run.get("detail", ""))[-2000:]
        if outcome == "stall" and s.note:
            v.detail = f"{s.note} ({v.detail})"
        # A stall passes only as a known one: the base bug a later stage fixes.
        v.passed = outcome == "stall" and base_bug_shows and s.base_bug_stalls
        return v
    if reference is None or reference.get("outcome") != "ran":
        v.outcome = "error"
        v.detail = (
            "the reference run did not complete: "
            + str((reference or {}).get("detail", "missing"))[-1500:]
        )
        return v
    refs = {r["key"]: r for r in reference.get("requests", [])}
    comparisons = []
    for got in run.get("requests", []):
        if got["key"] in refs:
            comparisons.append(compare_request(refs[got["key"]], got))
    if not comparisons:
        v.outcome = "error"
        v.detail = "no request in common with the reference"
        return v
    diff = max(c.max_logprob_diff for c in comparisons)
    v.max_logprob_diff = "inf" if math.isinf(diff) else diff
    equal = all(c.equal for c in comparisons)
    v.outcome = "equal" if equal else "not equal"
    v.cached = [
        [c.key, c.expected_cached, c.num_cached_tokens]
        for c in comparisons
        if c.expected_cached is not None
    ]
    v.checks["outputs"] = equal
    # A cached-token check that cannot pass without a hit: some request must
    # expect one, and every expectation must match. Load failures report what
    # the engine first scheduled: not checked (their "load failed" check is).
    if "load failed" not in s.checks:
        hits = [c for c in comparisons if c.expected_cached]
        v.cached_ok = bool(hits) and all(c.cached_ok for c in comparisons)
        v.checks["cached tokens"] = v.cached_ok
    if findings:
        v.checks["connector findings"] = False
        v.detail = "; ".join(findings[:5])
    if "load failed" in s.checks:
        v.checks["load failed"] = bool(conn.get("failed_loads"))
    if "read" in s.checks:
        # A NixlConnector consumer's worker read blocks and none failed.
        read = conn.get("nixl_blocks_read", {})
        v.figures["nixl_blocks_read"] = read
        v.checks["read"] = (
            bool(read) and all(read.values()) and not conn.get("failed_loads")
        )
    if "preempted" in s.checks:
        v.checks["preempted"] = (obs.get("preemptions") or 0) > 0
    if "window" in s.checks:
        # the long request of memory-window; the consumer of a NIXL P/D pair;
        # the request OffloadingConnector serves again from its second tier
        key = {"nixl": "nixl-a", "offload": "reload"}.get(s.connector or "", "long-b")
        v.checks["window"] = _window_ok(v, run, key)
    if s.connector == "offload":
        stored = dict(conn.get("stored_blocks_per_group", {}))
        held = dict(conn.get("held_blocks", {}))
        v.figures["stored_blocks_per_group"] = stored
        v.figures["held_blocks"] = held
        if "stored" in s.checks:
            # The first run's blocks went to the second tier in every group.
            first = stored.get("store", [])
            v.checks["stored"] = len(first) == max(1, len(v.groups)) and all(first)
        if "held" in s.checks:
            # The hold kept blocks a store still read (the race was set up).
            v.checks["held"] = sum(held.values()) > 0
    if obs.get("kv_events"):
        v.figures["kv_events"] = dict(obs["kv_events"])
    if "kv events" in s.checks:
        # The subscriber received every batch (no sequence number missed), the
        # stream evicted, and with HMA the engine kept its KV cache groups.
        ev = obs.get("kv_events") or {}
        v.checks["kv events"] = (
            ev.get("requests", 0) > 0
            and ev.get("removed", 0) > 0
            and ev.get("sequence_gaps") == 0
            and (len(v.groups) > 1) == hma
        )
        if s.connector == "offload":
            # The CPU tier evicted (its BlockRemoved were used) and served
            # hits the local prefix cache did not.
            v.checks["kv events"] = (
                v.checks["kv events"]
                and ev.get("cpu_removed", 0) > 0
                and ev.get("tier_hits", 0) > 0
            )
    if "producer freed" in s.checks:
        # The P/D producer's blocks are back in its pool after the consumer's read.
        held = (
            run.get("producer", {}).get("observation", {}).get("blocks_held_after_read")
        )
        v.figures["producer_blocks_held_after_read"] = held
        v.checks["producer freed"] = held == 0
    expected_equal = not base_bug_shows
    if s.expect == "caught":
        failed = [name for name, ok in v.checks.items() if not ok]
        v.caught_by = ", ".join(failed) or None
        v.passed = s.caught_by in failed
    elif expected_equal:
        v.passed = all(v.checks.values())
    elif s.base_bug_stalls:
        v.passed = False  # the known stall did not show: the scenario does not bite
        v.detail = f"known base stall (fixed at stage {fixed_at}) did not show"
    else:
        # the known base bug must show: a check fails (with a connector that
        # loads whole blocks the outputs may still be equal; the engine's
        # cached-token count then shows where it resumed)
        v.passed = not all(v.checks.values())
        v.detail = f"known base bug (fixed at stage {fixed_at}): {s.base_bug}"
    return v


def _window_ok(v: Verdict, run: dict, key: str = "long-b") -> bool:
    """Every sliding-window group held at most :func:`window_bound` blocks for
    the long request ``key`` (HMA on); with one group (HMA off) there is
    nothing to bound and the check passes only if that group held every block."""
    long = [r for r in run.get("requests", []) if r["key"] == key]
    peak = v.peak_blocks.get(key)
    if not long or not peak:
        return False
    new_tokens = long[0]["prompt_len"] - (long[0]["expected_cached"] or 0)
    bound = window_bound(new_tokens + len(long[0]["tokens"]))
    # sliding window and chunked local attention groups: both keep a window
    sliding = [
        i
        for i, g in enumerate(v.groups)
        if g.startswith(("SlidingWindow", "ChunkedLocalAttention"))
    ]
    v.figures["window_bound_blocks"] = bound
    if not sliding:
        return len(peak) == 1
    return all(peak[i] <= bound for i in sliding)


def admission_check(on: Verdict, off: Verdict) -> bool | None:
    """The series runs more long-prefix requests at once (HMA on) than HMA off
    in the same memory; None when either run has no figure."""
    a, b = on.figures.get("max_running"), off.figures.get("max_running")
    if a is None or b is None:
        return None
    return a > b
