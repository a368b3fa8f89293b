"""hmastack bench: the expected figures, and the deterministic scenarios run in
the real stage trees (skipped with a reason when build/env or a tree is missing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hmastack import bench, docs
from hmastack import config as config_mod
from hmastack import env as env_mod

ROOT = Path(__file__).resolve().parents[2]
B = 16


def test_expected_swa_blocks_formulas():
    # Through num_new_tokens: a block for every token.
    assert bench.expected_swa_blocks(131072, 1, 512, B, separate=False) == 8193
    # Separate external tokens: only the window (+ the new token) is real.
    assert bench.expected_swa_blocks(131072, 1, 512, B, separate=True) == 33
    assert bench.swa_min_blocks(512, B) == 33
    assert bench.expected_swa_blocks(131072, 1, 4096, B, separate=True) == 257
    # A hit shorter than the window keeps every block.
    assert bench.expected_swa_blocks(1024, 1, 4096, B, separate=True) == 65


def test_check_peak_reports_a_mismatch():
    row = {"pattern": "gemma3", "window": 512, "external": 8192, "new": 1}
    good = {**row, "full_blocks": 513, "swa_blocks": 33}
    bad = {**row, "full_blocks": 513, "swa_blocks": 513}
    rep = {"block_size": B, "separate_external_arg": True, "rows": [good]}
    assert bench.check_peak(rep) == []
    assert bench.check_peak({**rep, "rows": [bad]})


def test_expected_admission_figures():
    args = {"block_size": B, "new_tokens": 1, "num_blocks": 4096, "shared_prefix": 8192}
    base = bench.expected_admission(6, False, B, 1, 4096, 8192)
    assert base == {
        "longest_hit_hma_off": 10895,
        "concurrent_hma_off": 1,
        "longest_hit": 10911,
        "concurrent": 1,
    }
    assert bench.expected_admission(2, False, B, 1, 4096, 8192)["concurrent"] == 3
    row = {"pattern": "gemma3", "window": 512, **base}
    row |= {"longest_hit_physical": 62879, "concurrent_physical": 6}
    rep = {"separate_external_arg": False, "rows": [row]}
    assert bench.check_admission(rep, args) == []
    # With the separate external argument: the physical limits, exactly.
    rep = {"separate_external_arg": True, "rows": [row]}
    assert len(bench.check_admission(rep, args)) == 2
    row |= {"longest_hit": 62879, "concurrent": 6}
    assert bench.check_admission(rep, args) == []


def test_parse_stages():
    cfg = config_mod.load(ROOT)
    assert bench.parse_stages(None, cfg) == list(range(1, cfg.num_stages + 1))
    assert bench.parse_stages(None, cfg, quick=True) == [cfg.num_stages]
    assert bench.parse_stages("0,1-3", cfg) == [1, 2, 3]


def test_register_adds_bench_command():
    from hmastack.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--stages", "3", "--no-peer"])
    assert args.quick and args.no_peer and args.stages == "3"


def _cost_run(ms: dict[tuple, float], work: int = 100) -> dict:
    """One scheduler_cost run: rows keyed (connector, mode, requests) -> ms."""
    return {
        "rows": [
            {
                "connector": k[0],
                "mode": k[1],
                "requests": k[2],
                "cpu_ms_per_step": v,
                "scheduled_tokens": work,
                "finished": 0,
            }
            for k, v in ms.items()
        ]
    }


def test_cost_rows_pairs_rounds_by_setting():
    a, b = ("none", "decode", 64), ("connector", "decode", 64)
    results = {
        "stage 0": [_cost_run({a: 1.0, b: 2.0}), _cost_run({a: 2.0, b: 2.0})],
        # Rows in another order: matched by setting, not by position.
        "stage 3": [_cost_run({b: 3.0, a: 1.5}), _cost_run({b: 1.0, a: 2.0})],
        "v0.14.0": [_cost_run({a: 1.0, b: 2.0}, work=99)],
    }
    rows = {
        (r["tree"], r["connector"]): r for r in bench.cost_rows(list(results), results)
    }
    base = rows[("stage 0", "none")]
    assert (base["ratio min"], base["ratio median"], base["ratio max"]) == (1, 1, 1)
    s3 = rows[("stage 3", "none")]
    assert (s3["ratio min"], s3["ratio median"], s3["ratio max"]) == (1.0, 1.25, 1.5)
    assert s3["reps"] == 2 and s3["work = base"] is True
    s3c = rows[("stage 3", "connector")]
    assert (s3c["ratio min"], s3c["ratio max"]) == (0.5, 1.5)
    assert s3c["cpu ms min-max"] == "1.000-3.000"
    peer = rows[("v0.14.0", "none")]
    assert peer["reps"] == 1 and peer["work = base"] is False
    assert bench.cost_rows(["stage 0"], {"stage 0": []}) == []


def test_tree_colors_are_stable():
    assert bench.tree_color("stage 0") == "C0"
    assert bench.tree_color("stage 4") == "C4"
    assert bench.tree_color("v0.14.0") == "C9"


def _reports() -> dict[str, dict]:
    trees = ["stage 0", "stage 3", "v0.14.0"]
    peak = [
        {
            "tree": t,
            "pattern": p,
            "W": 512,
            "L": L,
            "full": L // B + 1,
            "swa/group": L // B + 1 if t == "stage 0" else 33,
            "swa min": 33,
        }
        for t in trees
        for p in ("gemma3", "gptoss")
        for L in (1024, 8192)
    ]
    admission = [
        {
            "tree": t,
            "pattern": p,
            "W": 512,
            "longest hit": 10911 if t == "stage 0" else 62879,
            "HMA off": 10895,
            "physical": 62879,
            "concurrent@8k": 1 if t == "stage 0" else 6,
            "conc. HMA off": 1,
            "conc. physical": 6,
        }
        for t in trees
        for p in ("gemma3", "gptoss")
    ]
    a, b = ("none", "prefill", 256), ("connector", "prefill", 256)
    runs = {
        t: [_cost_run({a: 1.0, b: 2.0}), _cost_run({a: 1.2, b: 1.8})] for t in trees
    }
    eagle = [
        {
            "tree": t,
            "pattern": "gptoss",
            "W": 128,
            "case": case,
            "prompt": 4101,
            "hit (eagle)": hit if t == "stage 5" else 4064,
            "rule": hit if t == "stage 5" or case != "connector async" else "-",
            "hit without eagle": 4096,
        }
        for t in ("stage 0", "stage 5", "v0.14.0")
        for case, hit in (("fully cached", 4080), ("connector async", 0))
    ]
    return {
        "eagle_hits": {"title": "eagle", "rows": eagle},
        "peak_blocks": {"title": "peak", "block_size": B, "rows": peak},
        "admission": {"title": "admission", "budget_blocks": 4096, "rows": admission},
        "scheduler_cost": {"title": "cost", "rows": bench.cost_rows(trees, runs)},
    }


def test_every_scenario_has_a_plot_and_the_site_shows_it(project):
    pytest.importorskip("matplotlib")
    out = project.reports / "bench"
    out.mkdir(parents=True)
    for name, report in _reports().items():
        (out / f"{name}.json").write_text(json.dumps(report))
        path = bench.plot(name, report, out)
        assert path == out / f"{name}.png"
        assert path.read_bytes().startswith(b"\x89PNG")
    (out / bench.SUMMARY).write_text(bench.summary_markdown(_reports()))
    site = docs.generate(project)
    page = site.pages["benchmarks.md"]
    assert "## Summary of the last run" in page
    assert "### Longest admitted external hit" in page
    for name in bench.SCENARIOS:
        assert f"![{name}](assets/bench/{name}.png)" in page
        assert f"assets/bench/{name}.png" in site.assets


def test_rounds_alternate_direction():
    trees = ["A", "B", "C"]
    assert [bench.round_order(trees, i) for i in range(3)] == [
        ["A", "B", "C"],
        ["C", "B", "A"],
        ["A", "B", "C"],
    ]


def test_summary_has_the_three_tables_one_column_per_tree():
    text = bench.summary_markdown(_reports())
    assert text.count("### ") == 5  # peak, longest hit, concurrency, cost, eagle
    peak, hit, conc, cost, eagle = text.split("### ")[1:]
    # One column per tree, then the rule and the hit without eagle of stage 5.
    assert "| gptoss | 128 | connector async | 4101 | 4064 | 0 | 4064 | 0 | 4096 |" in (
        eagle
    )
    assert "| gemma3 | 512 | 8192 | 513 | 33 | 513 | 33 | 33 |" in peak
    assert "| gemma3 | 512 | 10895 | 10911 | 62879 | 62879 | 62879 |" in hit
    assert "| gptoss | 512 | 1 | 1 | 6 | 6 | 6 |" in conc
    # Ratios of the non-base trees: median (min-max) over the rounds.
    assert "median (min-max) over 2 rounds" in cost
    assert (
        "| none | prefill | 256 | 1.1 | 1.00 (1.00-1.00) | 1.00 (1.00-1.00) |" in cost
    )
    assert bench.summary_markdown({}) == ""


def test_no_plot_without_rows(tmp_path):
    assert bench.plot("admission", {"rows": []}, tmp_path) is None
    # Only the base measured: no ratio to draw.
    rows = _reports()["scheduler_cost"]["rows"]
    base_only = {"rows": [r for r in rows if r["tree"] == "stage 0"]}
    assert bench.plot("scheduler_cost", base_only, tmp_path) is None


# --- the scenarios inside the real trees ----------------------------------------


def _tree(k: int) -> bench.BenchTree:
    cfg = config_mod.load(ROOT)
    pyenv = env_mod.location(cfg)
    if not pyenv.python.exists():
        pytest.skip(f"{pyenv.python} missing: run `hmastack env` first")
    return bench.BenchTree(f"stage {k}", bench.stage_tree(cfg, k))


def _run(k: int, name: str, args: dict) -> dict:
    tree = _tree(k)
    cfg = config_mod.load(ROOT)
    return bench.run_scenario(cfg, env_mod.location(cfg), tree, name, args)


PEAK_ARGS = {"lengths": [1024, 131072], "windows": [512, 4096], "block_size": B}


def test_peak_blocks_base_allocates_every_external_token():
    rep = _run(0, "peak_blocks", PEAK_ARGS)
    assert rep["separate_external_arg"] is False
    for r in rep["rows"]:
        total = math.ceil((r["external"] + r["new"]) / B)
        assert r["full_blocks"] == total
        assert r["swa_blocks"] == total  # allocate-then-free: no window bound
    assert bench.check_peak(rep) == []


def test_peak_blocks_stage3_holds_only_the_window():
    rep = _run(3, "peak_blocks", PEAK_ARGS)
    assert rep["separate_external_arg"] is True  # detected with inspect
    for r in rep["rows"]:
        total = math.ceil((r["external"] + r["new"]) / B)
        assert r["full_blocks"] == total
        # One new token: the window minimum exactly, or every block if fewer.
        assert r["swa_blocks"] == min(total, r["swa_min"])
    assert bench.check_peak(rep) == []


ADMIT_ARGS = {"windows": [512], "patterns": ["gemma3"], "num_blocks": 4096}


def test_admission_base_gains_nothing_from_hma_for_an_external_hit():
    (r,) = _run(0, "admission", ADMIT_ARGS)["rows"]
    # 6 groups x ceil((L+1)/16) <= 4095 vs one group of 4096 // 6 blocks.
    assert r["longest_hit"] == (4095 // 6) * B - 1
    assert abs(r["longest_hit"] - r["longest_hit_hma_off"]) <= B
    assert r["longest_hit"] < r["longest_hit_physical"] // 5
    assert r["concurrent"] == 1 < r["concurrent_physical"]


def test_admission_stage3_reaches_the_physical_limit():
    (r,) = _run(3, "admission", ADMIT_ARGS)["rows"]
    assert r["longest_hit"] == r["longest_hit_physical"] == 62879
    assert r["concurrent"] == r["concurrent_physical"] == 6


COST_ARGS = {"sizes": [64], "modes": ["decode", "prefill"], "steps": 3}


def test_scheduler_cost_with_the_scripted_connector_does_the_same_work():
    base = _run(0, "scheduler_cost", COST_ARGS)["rows"]
    stage3 = _run(3, "scheduler_cost", COST_ARGS)["rows"]
    assert [bench.cost_key(r) for r in base] == [
        ("none", "decode", 64),
        ("none", "prefill", 64),
        ("connector", "decode", 64),
        ("connector", "prefill", 64),
    ]
    for mine, theirs in zip(stage3, base, strict=True):
        # Timing aside, both trees schedule alike: the ratio compares like work.
        for key in ("scheduled_tokens", "finished", "hit_tokens"):
            assert mine[key] == theirs[key], (bench.cost_key(mine), key)
    for r in base:
        if r["connector"] == "connector":
            # 3/4 of the prompt in whole blocks, reported for every new request.
            assert r["hit_tokens"] == r["prompt_tokens"] * 3 // 4
            calls = r["connector_calls"]
            assert calls["matched"] >= calls["alloc"] > 0
            assert r["hma"] is False  # 0.13.0 turns HMA off with a connector
        if r["mode"] == "prefill":
            assert r["pool_left"] > 0  # steady state: never ran out of requests
            assert r["finished"] > 0
        else:
            assert r["scheduled_per_step"] == 64


def _eagle_row(case: str, **kw) -> dict:
    return {"case": case, "prompt": 4101} | kw


@pytest.mark.parametrize(
    "row,window,want",
    [
        (_eagle_row("fully cached"), 128, 4080),
        (_eagle_row("aligned", prompt=4096), 128, 4064),
        (_eagle_row("short", prompt=33), 128, 16),
        (_eagle_row("full evicted", evict=[[0, 100]]), 128, 1584),
        # Block 247 starts the window of token 4080 (W=128): the hit must end
        # before it, with block 246 computed again.
        (_eagle_row("swa evicted", evict=[[1, 247]]), 128, 3936),
        (_eagle_row("swa evicted", evict=[[1, 223]]), 512, 3552),
        # A connector's prefix: the sliding window group holds only the window
        # of token 4096 (blocks 248~255), the hit of 4080 tokens needs 247.
        (_eagle_row("async", external=4096, load="async"), 128, 0),
        (_eagle_row("sync", external=4096, load="sync"), 128, 0),
    ],
)
def test_expected_eagle_hit(row, window, want):
    assert bench.expected_eagle_hit(["full", "swa"], window, 16, row) == want


def test_eagle_check_flags_a_wrong_hit(monkeypatch):
    """Stage 5 is checked exactly (a tree giving 0.13.0's double drop fails),
    stage 4 and the peer are only reported."""
    row = _eagle_row("fully cached") | {"pattern": "gptoss", "window": 128}
    report = {"rows": [row | {"hit": 4064, "hit_no_eagle": 4096}]}
    monkeypatch.setattr(
        bench,
        "alternate",
        lambda cfg, pyenv, trees, name, args, reps: (
            {t.label: [report] for t in trees},
            {},
        ),
    )
    trees = [bench.BenchTree(label, None) for label in ("stage 4", "v0.14.0")]
    assert bench.bench_eagle(None, None, trees, bench.QUICK)["checked"] == "exact"
    trees.append(bench.BenchTree("stage 5", None))
    out = bench.bench_eagle(None, None, trees, bench.QUICK)
    assert out["checked"] == "MISMATCH"
    assert out["mismatches"] == [
        "stage 5: gptoss W=128 fully cached: hit 4064 (want 4080)"
    ]
    assert (
        "| gptoss | 128 | fully cached | 4101 | 4064 | 4064 | 4064 | 4080 | 4096 |"
        in (bench.eagle_markdown(out["rows"]))
    )


EAGLE_ARGS = {"patterns": ["gptoss"], "windows": [128], "block_size": B}


def test_eagle_hits_stage5_follows_the_rule_and_the_base_drops_twice():
    kinds = bench.GROUP_KINDS["gptoss"]
    stage5 = _run(5, "eagle_hits", EAGLE_ARGS)["rows"]
    for r in stage5:
        assert r["hit"] == bench.expected_eagle_hit(kinds, 128, B, r), r["case"]
    base = {r["case"]: r for r in _run(0, "eagle_hits", EAGLE_ARGS)["rows"]}
    # 0.13.0: full attention and sliding window each drop a block for eagle.
    assert base["fully cached"]["hit"] == base["fully cached"]["hit_no_eagle"] - 2 * B
    assert base["short prompt"]["hit"] == 0
