"""hmastack bench: the expected figures, and the deterministic scenarios run in
the real stage trees (skipped with a reason when build/env or a tree is missing)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import msgspec
import pytest
from hmastack_testkit.window import window_min_blocks

from hmastack.bench import cost as bench_cost
from hmastack.bench import figures
from hmastack.bench import plots as bench_plots
from hmastack.bench import run as bench
from hmastack.bench import tables as bench_tables
from hmastack.bench import trees as bench_trees
from hmastack.core import config as config_mod
from hmastack.core.errors import HmastackError
from hmastack.core.reports import write as write_report
from hmastack.site import bench as site_bench
from hmastack.site import docs
from hmastack.stack import env as env_mod
from hmastack.stack import series

from .conftest import TAG, write_stage

ROOT = Path(__file__).resolve().parents[2]
# The first stage whose external tokens get blocks only in the window: the one
# from which the test connector keeps HMA on (its stage.toml's hma).
WINDOW_STAGE = series.first_with(series.discover(config_mod.load(ROOT)), "test", "hma")
B = 16


def test_expected_swa_blocks_formulas():
    # Through num_new_tokens: a block for every token.
    assert figures.expected_swa_blocks(131072, 1, 512, B, separate=False) == 8193
    # Separate external tokens: only the window (+ the new token) is real.
    assert figures.expected_swa_blocks(131072, 1, 512, B, separate=True) == 33
    assert window_min_blocks(512, B) == 33
    assert figures.expected_swa_blocks(131072, 1, 4096, B, separate=True) == 257
    # A hit shorter than the window keeps every block.
    assert figures.expected_swa_blocks(1024, 1, 4096, B, separate=True) == 65


def test_check_peak_reports_a_mismatch():
    row = {"pattern": "gemma3", "window": 512, "external": 8192, "new": 1}
    good = {**row, "full_blocks": 513, "swa_blocks": 33}
    bad = {**row, "full_blocks": 513, "swa_blocks": 513}
    rep = {"block_size": B, "separate_external_arg": True, "rows": [good]}
    assert figures.check_peak(rep) == []
    assert figures.check_peak({**rep, "rows": [bad]})


def test_expected_admission_figures():
    args = {"block_size": B, "new_tokens": 1, "num_blocks": 4096, "shared_prefix": 8192}
    base = figures.expected_admission(6, False, B, 1, 4096, 8192)
    assert base == {
        "longest_hit_hma_off": 10895,
        "concurrent_hma_off": 1,
        "longest_hit": 10911,
        "concurrent": 1,
    }
    assert figures.expected_admission(2, False, B, 1, 4096, 8192)["concurrent"] == 3
    row = {"pattern": "gemma3", "window": 512, **base}
    row |= {"longest_hit_physical": 62879, "concurrent_physical": 6}
    rep = {"separate_external_arg": False, "rows": [row]}
    assert figures.check_admission(rep, args) == []
    # With the separate external argument: the physical limits, exactly.
    rep = {"separate_external_arg": True, "rows": [row]}
    assert len(figures.check_admission(rep, args)) == 2
    row |= {"longest_hit": 62879, "concurrent": 6}
    assert figures.check_admission(rep, args) == []


def test_parse_stages(project):
    write_stage(project.root, "00a-fix", 'tag = "Fix"\n')
    assert bench_trees.parse_stages(None, project) == [1, 2, 3]
    assert bench_trees.parse_stages(None, project, quick=True) == [3]
    assert bench_trees.parse_stages("base,01..02", project) == [2, 3]
    assert bench_trees.parse_stages("00a,02", project) == [1, 3]
    with pytest.raises(HmastackError, match="unknown stage '3'"):
        bench_trees.parse_stages("3", project)


def _bench_call(monkeypatch, argv: list[str]) -> dict:
    """The arguments `hmastack <argv>` calls :func:`bench.run_step` with."""
    from hmastack import cli
    from hmastack.core.steps import StepResult

    calls: list[dict] = []

    def run_step(cfg, **kw):
        calls.append(kw)
        return StepResult(False, "a checked figure is off")

    monkeypatch.setattr(bench, "run_step", run_step)
    assert cli.main(argv) == 1  # a failed step is the command's exit status 1
    (call,) = calls
    return call


def test_the_bench_command_passes_its_flags_to_the_step(monkeypatch):
    assert _bench_call(monkeypatch, ["bench"]) == {
        "quick": False,
        "stages": None,
        "no_peer": False,
        "instructions": True,
        "only": None,
        "throughput": False,
        "count_settings": None,
        "commits": True,
    }
    argv = ["bench", "--quick", "--stages", "3", "--no-peer", "--no-instructions"]
    argv += ["--only", "eagle_hits", "--throughput", "--no-commits"]
    assert _bench_call(monkeypatch, argv + ["--count-settings", "quick"]) == {
        "quick": True,
        "stages": "3",
        "no_peer": True,
        "instructions": False,
        "only": "eagle_hits",
        "throughput": True,
        "count_settings": "quick",
        "commits": False,
    }


def _cost_run(values: dict[tuple, float], work: int = 100) -> dict:
    """One scheduler-cost run: rows keyed (layout, connector, mode, requests)."""
    return {
        "rows": [
            {
                "layout": k[0],
                "connector": k[1],
                "mode": k[2],
                "requests": k[3],
                "cpu_ms_per_step": v,
                "instructions_per_step": v * 1e6,
                "scheduled_tokens": work,
                "finished": 0,
            }
            for k, v in values.items()
        ]
    }


def test_ratio_rows_pair_rounds_by_setting():
    a = ("full", "none", "decode", 64)
    b = ("gemma3", "connector", "decode", 64)
    results = {
        "stage 0": [_cost_run({a: 1.0, b: 2.0}), _cost_run({a: 2.0, b: 2.0})],
        # Rows in another order: matched by setting, not by position.
        "stage 3": [_cost_run({b: 3.0, a: 1.5}), _cost_run({b: 1.0, a: 2.0})],
        "v0.14.0": [_cost_run({a: 1.0, b: 2.0}, work=99)],
    }
    rows = {
        (r["tree"], r["layout"]): r
        for r in bench_cost.ratio_rows(list(results), results, "cpu_ms_per_step")
    }
    base = rows[("stage 0", "full")]
    assert (base["ratio min"], base["ratio median"], base["ratio max"]) == (1, 1, 1)
    assert base["spread %"] == round(100 * (2.0 - 1.0) / 1.5, 4)
    s3 = rows[("stage 3", "full")]
    assert (s3["ratio min"], s3["ratio median"], s3["ratio max"]) == (1.0, 1.25, 1.5)
    assert s3["reps"] == 2 and s3["work = base"] is True
    s3b = rows[("stage 3", "gemma3")]
    assert (s3b["ratio min"], s3b["ratio max"]) == (0.5, 1.5)
    assert (s3b["min"], s3b["max"]) == (1.0, 3.0)
    peer = rows[("v0.14.0", "full")]
    assert peer["reps"] == 1 and peer["work = base"] is False
    assert bench_cost.ratio_rows(["stage 0"], {"stage 0": []}, "x") == []


def test_tree_colors_are_stable():
    assert bench_plots.tree_color("base") == bench_plots.TAB10[0]
    assert bench_plots.tree_color("stage 00a") == bench_plots.TAB10[0]
    assert bench_plots.tree_color("stage 4") == bench_plots.TAB10[4]
    assert bench_plots.tree_color("v0.14.0") == bench_plots.TAB10[9]
    # Partial commits: lighter shades of their stage's colour, all distinct.
    shades = [bench_plots.tree_color(f"stage 3.{j}") for j in (1, 2)]
    assert len({*shades, bench_plots.tree_color("stage 3")}) == 3
    assert all(s.startswith("#") and len(s) == 7 for s in shades)
    assert bench_plots.tree_color("stage 4 slowed") == "#000000"


def _checked(title: str, rows: list[dict], **extra) -> dict:
    """A report of exact figures as its scenario writes it: every field of
    its schema (figures.CheckedReport)."""
    method = "the method"
    return {"title": title, "method": method, "checked": "exact", "mismatches": []} | {
        "errors": {},
        "rows": rows,
        **extra,
    }


def _counts_report(rows: list[dict]) -> dict:
    """The counts' report as counts.instruction_counts writes it, no profile."""
    return {
        "title": "instructions",
        "method": "the method",
        "unit": "instructions per step",
        "marker": "qsort",
        "hardware_counters": "perf is not installed",
        "steps": 6,
        "threshold": bench_cost.THRESHOLD,
        "named_above": bench_cost.NAMED,
        "trees": {},
        "preload_failed": [],
        "errors": {},
        "rows": rows,
        "profiles": [],
    }


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
            "swa groups": 5 if p == "gemma3" else 1,
            "swa min": 33,
            "swa/min": round((L // B + 1 if t == "stage 0" else 33) / 33, 2),
            "pool blocks": 6 * (L // B + 1),
            "external arg": t != "stage 0",
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
    a = ("full", "none", "prefill", 256)
    b = ("gemma3", "connector", "prefill", 256)
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
    layout = [
        {
            "tree": t,
            "layout": "full+mamba",
            "figure": "peak, group 1 (mamba)",
            "L": L,
            "value": L // B + 1 if t == "stage 0" else 2,
            "physical": 2,
            "/physical": (L // B + 1) / 2 if t == "stage 0" else 1.0,
            "/base": "-" if t == "v0.14.0" else (1.0 if t == "stage 0" else 0.03),
            "checked": "-" if t == "v0.14.0" else "physical",
        }
        for t in trees
        for L in (1024, 8192)
    ]
    return {
        "layout_memory": _checked("layouts", layout, budget_blocks=4096),
        "eagle_hits": _checked("eagle", eagle),
        "peak_blocks": _checked("peak", peak, block_size=B),
        "admission": _checked("admission", admission, budget_blocks=4096),
        "scheduler_instructions": _counts_report(
            bench_cost.ratio_rows(trees, runs, "instructions_per_step")
        ),
        "scheduler_cost": {
            "title": "cost",
            "method": "the method",
            "unit": "CPU ms per step",
            "steps": 10,
            "errors": {},
            "rows": bench_cost.ratio_rows(trees, runs, "cpu_ms_per_step"),
        },
    }


def test_every_scenario_has_a_plot_and_the_site_shows_it(project):
    out = project.reports / "bench"
    out.mkdir(parents=True)
    for name, report in _reports().items():
        (out / f"{name}.json").write_text(json.dumps(report))
        path = bench.plot(name, report, out)
        assert path == out / f"{name}.png"
        assert path.read_bytes().startswith(b"\x89PNG")
    (out / bench.SUMMARY).write_text(bench_tables.summary_markdown(_reports()))
    site = docs.generate(project)
    page = site.pages["benchmarks.md"]
    assert "## Summary of the last run" in page
    assert "### Longest admitted external hit" in page
    # The optional throughput has its own page test (test_bench_throughput.py).
    names = [s.name for s in bench.SCENARIOS if s.name not in bench.OPTIONAL]
    assert sorted(names) == sorted(_reports())
    for name in names:
        assert f"![{name}](assets/bench/{name}.png)" in page
        assert f"assets/bench/{name}.png" in site.assets


def test_rounds_alternate_direction():
    trees = ["A", "B", "C"]
    assert [bench_trees.round_order(trees, i) for i in range(3)] == [
        ["A", "B", "C"],
        ["C", "B", "A"],
        ["A", "B", "C"],
    ]


def _cells(text: str) -> str:
    """A Markdown table with the padding around its cells removed."""
    return re.sub(r" *\| *", "|", text)


def test_summary_has_the_tables_one_column_per_tree():
    text = bench_tables.summary_markdown(_reports())
    # peak, longest hit, concurrency, instructions, CPU time, eagle, layouts
    assert text.count("### ") == 7
    peak, hit, conc, counts, cpu, eagle, layouts = (
        _cells(t) for t in text.split("### ")[1:]
    )
    assert "|gemma3|512|8192|513|33|513|33|33|" in peak
    assert "|gemma3|512|10895|10911|62879|62879|62879|" in hit
    assert "|gptoss|512|1|1|6|6|6|" in conc
    # The base's figure and its spread over runs, then each tree's ratio:
    # median (min-max) over the rounds.
    assert "median (min-max) over 2 round(s)" in counts
    assert "|full|none|prefill|256|1,100,000|18.1818%|1.000 (1.000-1.000)|" in counts
    assert "|gemma3|connector|prefill|256|1.900 ms|10.5263%|" in cpu
    # One column per tree, then the rule and the hit without eagle of stage 5.
    assert "|gptoss|128|connector async|4101|4064|0|4064|0|4096|" in eagle
    # The physical limit, then each tree's figure with its ratio to the base.
    assert "|peak, group 1 (mamba)|8192|2|513|2 (x0.03)|2|" in layouts
    assert bench_tables.summary_markdown({}) == ""


def test_a_ratio_above_the_threshold_is_marked():
    a = ("gptoss", "connector", "decode", 64)
    runs = {"stage 0": [_cost_run({a: 1.0})], "stage 3": [_cost_run({a: 1.02})]}
    report = {"rows": bench_cost.ratio_rows(list(runs), runs, "cpu_ms_per_step")}
    assert "|**1.020**|" in _cells(bench_tables.ratio_table(report, "x", "{}"))


def test_no_plot_without_rows(tmp_path):
    assert bench.plot("admission", {"rows": []}, tmp_path) is None
    # Only the base measured: no ratio to draw.
    rows = _reports()["scheduler_cost"]["rows"]
    base_only = {"rows": [r for r in rows if r["tree"] == "stage 0"]}
    assert bench.plot("scheduler_cost", base_only, tmp_path) is None


# --- the scenarios inside the real trees ----------------------------------------


def _tree(k: int) -> bench_trees.BenchTree:
    cfg = config_mod.load(ROOT)
    pyenv = env_mod.location(cfg)
    if not pyenv.python.exists():
        pytest.skip(f"{pyenv.python} missing: run `hmastack env` first")
    return bench_trees.bench_tree(cfg, k)


def _run(k: int, name: str, args: dict) -> dict:
    tree = _tree(k)
    cfg = config_mod.load(ROOT)
    return bench_trees.run_scenario(cfg, env_mod.location(cfg), tree, name, args)


PEAK_ARGS = {"lengths": [1024, 131072], "windows": [512, 4096], "block_size": B}


@pytest.mark.vllm_tree
def test_peak_blocks_base_allocates_every_external_token():
    rep = _run(0, "peak_blocks", PEAK_ARGS)
    assert rep["separate_external_arg"] is False
    for r in rep["rows"]:
        total = math.ceil((r["external"] + r["new"]) / B)
        assert r["full_blocks"] == total
        assert r["swa_blocks"] == total  # allocate-then-free: no window bound
    assert figures.check_peak(rep) == []


@pytest.mark.vllm_tree
def test_peak_blocks_stage3_holds_only_the_window():
    rep = _run(WINDOW_STAGE.number, "peak_blocks", PEAK_ARGS)
    assert rep["separate_external_arg"] is True  # detected with inspect
    for r in rep["rows"]:
        total = math.ceil((r["external"] + r["new"]) / B)
        assert r["full_blocks"] == total
        # One new token: the window minimum exactly, or every block if fewer.
        assert r["swa_blocks"] == min(total, r["swa_min"])
    assert figures.check_peak(rep) == []


ADMIT_ARGS = {"windows": [512], "patterns": ["gemma3"], "num_blocks": 4096}


@pytest.mark.vllm_tree
def test_admission_base_gains_nothing_from_hma_for_an_external_hit():
    (r,) = _run(0, "admission", ADMIT_ARGS)["rows"]
    # 6 groups x ceil((L+1)/16) <= 4095 vs one group of 4096 // 6 blocks.
    assert r["longest_hit"] == (4095 // 6) * B - 1
    assert abs(r["longest_hit"] - r["longest_hit_hma_off"]) <= B
    assert r["longest_hit"] < r["longest_hit_physical"] // 5
    assert r["concurrent"] == 1 < r["concurrent_physical"]


@pytest.mark.vllm_tree
def test_admission_stage3_reaches_the_physical_limit():
    (r,) = _run(WINDOW_STAGE.number, "admission", ADMIT_ARGS)["rows"]
    assert r["longest_hit"] == r["longest_hit_physical"] == 62879
    assert r["concurrent"] == r["concurrent_physical"] == 6


COST_ARGS = {
    "meter": "cpu",
    "steps": 3,
    "settings": bench_cost.settings(sizes=(64,)),
}


@pytest.mark.vllm_tree
def test_scheduler_cost_with_the_scripted_connector_does_the_same_work():
    base = _run(0, "scheduler_cost", COST_ARGS)["rows"]
    stage3 = _run(WINDOW_STAGE.number, "scheduler_cost", COST_ARGS)["rows"]
    assert [bench_cost.key(r) for r in base] == [
        bench_cost.key(s) for s in COST_ARGS["settings"]
    ]
    for mine, theirs in zip(stage3, base, strict=True):
        # Timing aside, both trees schedule alike: the ratio compares like work.
        for key in ("scheduled_tokens", "finished", "hit_tokens", "groups"):
            assert mine[key] == theirs[key], (bench_cost.key(mine), key)
    for r in base:
        # HMA on in every setting, also with the connector on 0.13.0 (forced).
        assert r["hma"] is True
        assert r["groups"] == {"full": 1, "gemma3": 6, "gptoss": 2}[r["layout"]]
        assert r["meter_calls"] == 2 * r["steps"] and r["cpu_s"] > 0
        if r["connector"] == "connector":
            # 3/4 of the prompt in whole blocks, reported for every new request.
            assert r["hit_tokens"] == r["prompt_tokens"] * 3 // 4
            calls = r["connector_calls"]
            assert (
                calls["get_num_new_matched_tokens"]
                >= calls["update_state_after_alloc"]
                > 0
            )
        if r["mode"] == "prefill":
            assert r["pool_left"] > 0  # steady state: never ran out of requests
            assert r["finished"] > 0
        else:
            assert r["scheduled_per_step"] == 64


# --- trees: per-commit prefixes and the slowed copy --------------------------------


def test_insert_statement_goes_after_the_docstring():
    source = (
        "class A:\n"
        "    def f(self, x):\n"
        '        """Doc.\n\n        More."""\n'
        "        return x\n"
        "\n"
        "def g():\n"
        "    return 1\n"
    )
    out = bench_trees.insert_statement(source, "A.f", "x += 1")
    assert out.splitlines()[5] == "        x += 1"
    ns: dict = {}
    exec(compile(out, "m", "exec"), ns)
    assert ns["A"]().f(1) == 2
    assert "    y = 0\n    return 1" in bench_trees.insert_statement(
        source, "g", "y = 0"
    )
    with pytest.raises(HmastackError, match="no function A.h"):
        bench_trees.insert_statement(source, "A.h", "pass")
    with pytest.raises(HmastackError, match="no class B"):
        bench_trees.insert_statement(source, "B.f", "pass")


@pytest.mark.vllm_tree
def test_commit_trees_are_the_proper_prefixes_of_a_stage():
    from hmastack.core.gitutil import git
    from hmastack.stack import workspace

    cfg = config_mod.load(ROOT)
    if not (cfg.workspace("vllm") / ".git").exists():
        pytest.skip("no vLLM workspace: run `hmastack base` first")
    found = workspace.discover(cfg)
    multi = [s for s in found if len(s.patches_for("vllm")) > 1]
    if not multi:
        pytest.skip("no stage has several vLLM commits")
    stage = multi[0]
    trees = bench_trees.commit_trees(cfg, [stage.number])
    n = len(stage.patches_for("vllm"))
    assert [t.label for t in trees] == [f"stage {stage.key}.{j}" for j in range(1, n)]
    before = sum(len(s.patches_for("vllm")) for s in found[: stage.number - 1])
    for j, t in enumerate(trees, 1):
        count = git(t.path, "rev-list", "--count", "v0.13.0..HEAD").strip()
        assert int(count) == before + j
        assert f"[{stage.tag}]" in t.note  # the commit's subject


def test_the_page_opens_with_headline_and_plots_then_method(project):
    out = project.reports / "bench"
    out.mkdir(parents=True)
    reports = _reports()
    counts = reports["scheduler_instructions"]
    counts["threshold"] = bench_cost.THRESHOLD
    counts["profiles"] = [
        {
            "tree": "stage 3",
            "setting": "gemma3-connector-prefill-256",
            "instructions base": 1000,
            "instructions": 1030,
            "bytecodes base": 100,
            "bytecodes": 110,
            "python_functions": [
                {
                    "function": "vllm/v1/core/kv_cache_manager.py:KVCacheManager.f",
                    "self base": 10,
                    "self": 20,
                    "self difference": 10,
                    "share": 1.0,
                    "inclusive difference": 10,
                    "calls base": 1,
                    "calls": 1,
                }
            ],
            "expected functions": ["vllm/v1/core/kv_cache_manager.py:KVCacheManager.f"],
            "why": "It reads what it must.",
            "c_functions": [
                {
                    "function": "_PyEval_EvalFrameDefault [libpython3.11.so.1.0]",
                    "base": 500,
                    "other": 530,
                    "difference": 30,
                    "share": 1.0,
                }
            ],
        }
    ]
    counts["witness"] = {
        "tree": "stage 4 slowed",
        "of": "stage 4",
        "slowdown": "a loop",
        "caught": True,
        "rows": [
            {
                "layout": "full",
                "connector": "none",
                "mode": "decode",
                "requests": 64,
                "ratio median": 1.05,
            }
        ],
        "named": ["vllm/v1/core/kv_cache_manager.py:KVCacheManager.allocate_slots"],
    }
    for name, report in reports.items():
        (out / f"{name}.json").write_text(json.dumps(report))
        bench.plot(name, report, out)
    (out / "run.json").write_text(json.dumps({"quick": True, "seconds": 300}))
    page = docs.generate(project).pages["benchmarks.md"]
    order = [
        page.index("## Headline"),
        page.index("## Plots"),
        page.index("## Scheduler instructions per step"),
        page.index("## Where the cost goes"),
        page.index("## Witness"),
        page.index("## Method"),
    ]
    assert order == sorted(order)
    headline = page[order[0] : order[1]]
    assert "**Peak blocks**" in headline and "**Admission**" in headline
    assert "**Witness**: stage 4 slowed" in headline and "is caught" in headline
    assert "not measured yet" in headline  # throughput: no report yet
    assert "quick set" in headline and "300 s" in headline
    assert "`vllm/v1/core/kv_cache_manager.py:KVCacheManager.f`" in page
    assert "`_PyEval_EvalFrameDefault [libpython3.11.so.1.0]`" in page
    assert "**Expected**: It reads what it must." in page


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
        # A connector's prefix: the sliding window group holds the window of
        # token 4080 (blocks 247~255), the last block boundary before the
        # loaded tokens: the hit of 4080 tokens, as fully cached.
        (_eagle_row("async", external=4096, load="async"), 128, 4080),
        (_eagle_row("sync", external=4096, load="sync"), 128, 4080),
        # Loaded tokens inside a block (4090): the window of token 4080 too.
        (_eagle_row("inside", external=4090, load="sync"), 128, 4080),
    ],
)
def test_expected_eagle_hit(row, window, want):
    assert figures.expected_eagle_hit(["full", "swa"], window, 16, row) == want


def test_eagle_check_flags_a_wrong_hit(monkeypatch, project):
    """The stage whose [bench] checks names the eagle rule is checked exactly
    (a tree giving 0.13.0's double drop fails), the stage before it and the
    peer are only reported."""
    (project.patches / "02-second" / "stage.toml").write_text(
        TAG + '[bench]\nchecks = ["eagle-rule"]\n'
    )
    row = _eagle_row("fully cached") | {"pattern": "gptoss", "window": 128}
    report = {"rows": [row | {"hit": 4064, "hit_no_eagle": 4096}]}
    monkeypatch.setattr(
        figures,
        "_run_each",
        lambda cfg, pyenv, trees, name, args: ({t.label: [report] for t in trees}, {}),
    )
    trees = [
        bench_trees.BenchTree("stage 01", None, stage=1),
        bench_trees.BenchTree("v0.14.0", None),
    ]
    assert figures.bench_eagle(project, None, trees, bench.QUICK)["checked"] == "exact"
    trees.append(bench_trees.BenchTree("stage 02", None, stage=2))
    out = figures.bench_eagle(project, None, trees, bench.QUICK)
    assert out["checked"] == "MISMATCH"
    assert out["mismatches"] == [
        "stage 02: gptoss W=128 fully cached: hit 4064 (want 4080)"
    ]
    assert "checked exactly from stage 02 on" in out["method"]
    assert "|gptoss|128|fully cached|4101|4064|4064|4064|4080|4096|" in _cells(
        bench_tables.eagle_markdown(out["rows"])
    )


def test_eagle_check_flags_a_hit_below_the_base(monkeypatch, project):
    """A stage, or a commit of one, before the rule's stage whose hit is below
    the base's fails the check (a regression a later stage fixes); the peer
    is only reported."""
    row = _eagle_row("connector sync", external=4096, load="sync")
    row |= {"pattern": "gptoss", "window": 128, "hit_no_eagle": 4096}
    hits = {"base": 4064, "stage 01": 4064, "stage 01.2": 0, "v0.14.0": 0}
    numbers = {"base": 0, "stage 01": 1, "stage 01.2": 1, "v0.14.0": None}
    monkeypatch.setattr(
        figures,
        "_run_each",
        lambda cfg, pyenv, trees, name, args: (
            {t.label: [{"rows": [row | {"hit": hits[t.label]}]}] for t in trees},
            {},
        ),
    )
    trees = [bench_trees.BenchTree(k, None, stage=numbers[k]) for k in hits]
    out = figures.bench_eagle(project, None, trees, bench.QUICK)
    assert out["mismatches"] == [
        "stage 01.2: gptoss W=128 connector sync: hit 0 (the base's 4064)"
    ]
    assert "checked exactly nowhere" in out["method"]


EAGLE_ARGS = {"patterns": ["gptoss"], "windows": [128], "block_size": B}


@pytest.mark.vllm_tree
def test_eagle_hits_of_the_rules_stage_follow_it_and_the_base_drops_twice():
    kinds = figures.GROUP_KINDS["gptoss"]
    rule = figures.check_from(config_mod.load(ROOT), "eagle-rule")
    assert rule is not None
    for r in _run(rule, "eagle_hits", EAGLE_ARGS)["rows"]:
        assert r["hit"] == figures.expected_eagle_hit(kinds, 128, B, r), r["case"]
    base = {r["case"]: r for r in _run(0, "eagle_hits", EAGLE_ARGS)["rows"]}
    # 0.13.0: full attention and sliding window each drop a block for eagle.
    assert base["fully cached"]["hit"] == base["fully cached"]["hit_no_eagle"] - 2 * B
    assert base["short prompt"]["hit"] == 0


@pytest.mark.parametrize("commits", [True, False])
def test_no_commits_leaves_out_the_trees_per_commit_prefix(monkeypatch, commits):
    """`hmastack bench --no-commits` counts the base, the stages and the peer;
    without it each stage is preceded by its commit prefixes."""
    call = _bench_call(monkeypatch, ["bench"] + ([] if commits else ["--no-commits"]))
    plan = bench.bench_plan(call["quick"], call["count_settings"], call["commits"])
    assert plan["commits"] is commits
    assert bench.bench_plan(False, "quick", commits)["commits"] is commits

    asked = []

    def commit_trees(cfg, numbers):
        asked.append(numbers)
        return [
            bench_trees.BenchTree(f"stage {k}.1", Path(f"/{k}.1"), stage=k)
            for k in numbers
        ]

    monkeypatch.setattr(figures, "commit_trees", commit_trees)
    trees = [
        bench_trees.BenchTree(label, Path(f"/{label}"), stage=k)
        for label, k in (("stage 0", 0), ("stage 3", 3), ("stage 5", 5))
    ] + [bench_trees.BenchTree(bench_trees.PEER_LABEL, Path("/peer"))]
    ctx = figures.Context(cfg=None, pyenv=None, trees=trees, plan=plan, quick=False)
    labels = [t.label for t in figures.count_trees(ctx)]
    if commits:
        assert asked == [[3, 5]]
        assert labels == [
            "stage 0",
            "stage 3.1",
            "stage 3",
            "stage 5.1",
            "stage 5",
            "v0.14.0",
        ]
    else:
        assert asked == []
        assert labels == ["stage 0", "stage 3", "stage 5", "v0.14.0"]


def test_quick_with_the_full_count_settings_is_refused():
    with pytest.raises(HmastackError, match="drop --quick"):
        bench.bench_plan(True, "full")
    assert bench.bench_plan(True, None) is bench.QUICK
    assert bench.bench_plan(True, "quick") is bench.QUICK


def test_count_settings_by_name_count_those_settings_alone():
    """Settings named on the command line are counted (and timed) alone, in
    the full set's order, the witness on the quick set's; a name of no setting
    and names with --quick are refused."""
    plan = bench.bench_plan(False, "longswa-hook-decode-1, full-connector-prefill-64")
    names = ["full-connector-prefill-64", "longswa-hook-decode-1"]
    assert [bench_cost.label(s) for s in plan["counts"]["settings"]] == names
    assert [bench_cost.label(s) for s in plan["cost"]["settings"]] == names
    assert plan["counts"]["witness_settings"] == bench_cost.WITNESS_QUICK
    assert plan["counts"]["steps"] == bench.FULL["counts"]["steps"]
    with pytest.raises(HmastackError, match="no setting is named full-x-decode-64"):
        bench.bench_plan(False, "full-x-decode-64,longswa-hook-decode-1")
    with pytest.raises(HmastackError, match="drop --quick"):
        bench.bench_plan(True, "longswa-hook-decode-1")


def _count_row(tree: str, ratio: float, mode: str = "prefill") -> dict:
    return {
        "tree": tree,
        "layout": "full",
        "connector": "none",
        "mode": mode,
        "requests": 64,
        "ratio median": ratio,
    }


def test_a_stage_above_the_base_without_a_named_function_fails_the_counts():
    rows = [
        _count_row("stage 0", 1.0),
        _count_row("stage 3", 1.004),
        _count_row("stage 3", 0.98, mode="decode"),
        _count_row("stage 3.2", 1.02, mode="decode"),
        _count_row(bench_trees.PEER_LABEL, 1.03),
    ]
    report = {"rows": rows, "profiles": []}
    assert [bench_cost.to_profile(r) for r in rows] == [
        False,
        True,
        False,
        True,
        True,
    ]
    failed = figures.count_failed(report)
    assert len(failed) == 2, failed
    assert failed[0].startswith("stage 3 full-none-prefill-64: ratio 1.004")
    assert failed[1].startswith("stage 3.2 full-none-decode-64")
    # A profile that names no Python function does not explain the row.
    report["profiles"] = [
        {"tree": "stage 3", "setting": "full-none-prefill-64", "python_functions": []},
        {
            "tree": "stage 3.2",
            "setting": "full-none-decode-64",
            "python_functions": [{"function": "vllm/v1/core/x.py:f"}],
        },
    ]
    assert len(figures.count_failed(report)) == 1
    report["profiles"][0]["python_functions"] = [{"function": "vllm/v1/core/y.py:g"}]
    assert figures.count_failed(report) == []


def test_an_expectation_the_profile_does_not_show_fails_the_counts(project):
    """A stage's expectation of a setting explains the profiles of that stage
    and the stages after it (not the base, earlier stages, commit prefixes or
    the peer); a later stage's expectation of the setting replaces it; one
    whose functions the profile does not show fails the command."""
    expected = (
        TAG + '[[bench.expected]]\nsetting = "full-none-prefill"\n'
        'functions = ["vllm/v1/core/x.py:f", "vllm/v1/core/x.py:h"]\n'
        'why = "Because."\n'
    )
    # The project's stages 01 and 02 expect nothing.
    write_stage(project.root, "02a-b", expected)
    write_stage(project.root, "03-c")
    write_stage(project.root, "04-d", expected.replace("Because.", "Again."))
    stages = series.discover(project)
    trees = ["stage 02", "stage 02a", "stage 03", "stage 04", "stage 03.2", "base"]
    trees.append(bench_trees.PEER_LABEL)
    profiles = bench_cost.explain(
        [
            {
                "tree": t,
                "setting": "full-none-prefill-64",
                "python_functions": [{"function": "vllm/v1/core/x.py:f"}],
            }
            for t in trees
        ],
        stages,
    )
    whys = [p.get("why") for p in profiles]
    assert whys == [None, "Because.", "Because.", "Again.", None, None, None]
    assert bench_cost.expected_for(stages, "stage 03", "full-none-decode-64") is None
    report = {"rows": [_count_row(t, 1.02) for t in trees], "profiles": profiles}
    assert figures.count_failed(report) == []
    assert bench_cost.shown(profiles[1]) == ["vllm/v1/core/x.py:f"]
    profiles[1]["python_functions"] = [{"function": "vllm/v1/core/y.py:g"}]
    assert figures.count_failed(report) == [
        "stage 02a full-none-prefill-64: the expected cost names "
        "vllm/v1/core/x.py:f, vllm/v1/core/x.py:h, the profile shows none of them"
    ]


def test_each_expectation_is_a_setting_of_the_full_set():
    """Every ``[[bench.expected]]`` of the series names a setting of the full
    set, functions and a reason."""
    stages = series.discover(config_mod.load(ROOT))
    settings = {bench_cost.label(s).rpartition("-")[0] for s in bench_cost.ALL_SETTINGS}
    expected = [e for s in stages for e in s.info.bench.expected]
    assert expected
    for e in expected:
        assert e.setting in settings
        assert e.functions and e.why


def test_the_last_run_line_gives_each_scenario_its_seconds():
    from hmastack.bench.report import BenchRun
    from hmastack.site import bench as site_bench

    run = BenchRun(True, 475, [], None, [], [], "2026-01-01 00:00:00")
    reports = {
        "peak_blocks": msgspec.convert(
            _checked("peak", [], block_size=B, seconds=66), figures.PeakReport
        ),
        "admission": msgspec.convert(
            _checked("admission", [], budget_blocks=4096, seconds=72),
            figures.AdmissionReport,
        ),
        # a report without its seconds: left out
        "eagle_hits": msgspec.convert(_checked("eagle", []), figures.EagleReport),
    }
    last = site_bench.headline(reports, run)[-1]
    assert last.startswith("Last run: quick set, 2026-01-01 00:00:00, 475 s")
    assert "(by scenario, from its report: peak_blocks 66 s, admission 72 s)" in last
    assert "eagle_hits" not in last
    assert "by scenario" not in site_bench.headline({}, run)[-1]


def test_a_bench_report_without_rows_names_the_file(project):
    """The site reads a scenario's rows from ``rows`` only: a report of
    another shape is an error naming it and the command, not an empty table."""
    out = project.reports / "bench"
    out.mkdir(parents=True)
    (out / "admission.json").write_text(json.dumps({"results": []}))
    with pytest.raises(HmastackError) as exc:
        docs.generate(project)
    assert "admission.json" in exc.value.message and "hmastack bench" in exc.value.hint


# --- each scenario's report: one schema beside its writer ------------------------


def _tree_outputs(name: str) -> dict:
    """One tree's output of a deterministic scenario, shaped as its script in
    bench/scenarios/ prints it."""
    if name == "peak_blocks":
        row = {"pattern": "gptoss", "window": 512, "external": 1024, "new": 1}
        row |= {"full_blocks": 65, "swa_blocks": 65, "swa_groups": 1}
        row |= {"swa_min": 33, "pool_taken": 130}
        return {"separate_external_arg": False, "block_size": B, "rows": [row]}
    if name == "admission":
        row = {"pattern": "gptoss", "window": 512, "longest_hit": 32735}
        row |= {"longest_hit_hma_off": 32735, "longest_hit_physical": 65487}
        row |= {"concurrent": 3, "concurrent_hma_off": 3, "concurrent_physical": 7}
        return {"separate_external_arg": False, "rows": [row]}
    row = _eagle_row("fully cached") | {"pattern": "gptoss", "window": 128}
    return {"rows": [row | {"hit": 4064, "hit_no_eagle": 4096}]}


WRITERS = {
    "peak_blocks": figures.bench_peak,
    "admission": figures.bench_admission,
    "eagle_hits": figures.bench_eagle,
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_each_writer_gives_its_schema_every_field(monkeypatch, project, name):
    """What a scenario's writer returns decodes as its schema, is written as
    such and read back by the site's reader field for field; a writer that
    drops a field of its rows or of its report fails here."""
    monkeypatch.setattr(
        figures,
        "_run_each",
        lambda cfg, pyenv, trees, _, args: (
            {t.label: [_tree_outputs(name)] for t in trees},
            {},
        ),
    )
    trees = [
        bench_trees.BenchTree("base", None, stage=0),
        bench_trees.BenchTree("stage 02", None, stage=2),
    ]
    report = WRITERS[name](project, None, trees, bench.QUICK)
    scenario = next(s for s in bench.SCENARIOS if s.name == name)
    encoded = bench.encode(scenario, report)
    assert isinstance(encoded, scenario.schema) and len(encoded.rows) == 2
    out = project.reports / "bench"
    write_report(out / f"{name}.json", encoded)
    assert bench.read_report(out, name) == encoded
    # The report as it is on disk: every key the writer gave, no other.
    on_disk = json.loads((out / f"{name}.json").read_text())
    assert set(on_disk["rows"][0]) == set(report["rows"][0])


def test_the_no_instructions_report_is_a_whole_count_report():
    ctx = figures.Context(None, None, [], bench.QUICK, True)
    scenario = next(s for s in bench.SCENARIOS if s.name == "scheduler_instructions")
    encoded = bench.encode(scenario, figures.run_instructions(ctx))
    assert encoded.rows == [] and encoded.method == "not counted (--no-instructions)"


def test_a_writer_that_drops_a_field_is_refused_before_the_report_is_written():
    scenario = next(s for s in bench.SCENARIOS if s.name == "scheduler_cost")
    report = _reports()["scheduler_cost"]
    del report["rows"][0]["ratio median"]
    with pytest.raises(HmastackError) as exc:
        bench.encode(scenario, report)
    assert "scheduler_cost" in exc.value.message and "CostReport" in exc.value.message
    assert "`ratio median`" in exc.value.message


@pytest.mark.parametrize(
    "name, drop, where",
    [
        ("peak_blocks", ("rows", 0, "swa min"), "`swa min` - at `$.rows[0]`"),
        ("admission", ("budget_blocks",), "`budget_blocks`"),
        ("scheduler_instructions", ("threshold",), "`threshold`"),
    ],
)
def test_a_report_missing_a_field_names_its_file_and_the_step(
    project, name, drop, where
):
    """The site decodes each scenario's report as its schema: a report that
    misses a field (written by another version of the writer) is refused with
    the file, the field and the command that writes it anew, not shown with a
    guessed value."""
    out = project.reports / "bench"
    out.mkdir(parents=True)
    report = _reports()[name]
    *path, key = drop
    holder = report
    for k in path:
        holder = holder[k]
    del holder[key]
    (out / f"{name}.json").write_text(json.dumps(report))
    with pytest.raises(HmastackError) as exc:
        docs.generate(project)
    assert f"{name}.json does not match the report" in exc.value.message
    assert f"Object missing required field {where}" in exc.value.message
    assert "run `hmastack bench` again" in exc.value.hint


def test_a_tree_the_bench_leaves_out_is_named_in_the_steps_outcome(
    project, monkeypatch
):
    """`hmastack run`'s summary shows the step's outcome: a peer release the run
    could not use appears there with why, not only in the console."""
    why = "vLLM 0.14.0 has no tree: run `hmastack bench` with network once"
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: (False, {"peer": why}))
    result = bench.run_step(project, quick=True)
    assert result.ok and f"skipped peer: {why}" in result.outcome
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: (True, {}))
    result = bench.run_step(project, quick=True)
    assert not result.ok and "skipped" not in result.outcome


def test_a_report_no_scenario_writes_is_an_error_not_a_guessed_table(project):
    """The site reads each report with its scenario's schema; a JSON file in
    the bench folder that no scenario writes is refused with its path."""
    out = project.reports / "bench"
    out.mkdir(parents=True)
    (out / "renamed_scenario.json").write_text('{"rows": [{"a": 1}]}')
    with pytest.raises(HmastackError, match=r"renamed_scenario\.json: no scenario"):
        docs.generate(project)


MAMBA_LAYOUT = """
[[bench.layouts]]
name = "full+mamba"
groups = ["full", "mamba"]
lengths = [1024]
"""


def _layout_output(mamba_blocks: int, longest: int, concurrent: int) -> dict:
    """One tree's output of bench/scenarios/layout_memory.py for the layout
    of :data:`MAMBA_LAYOUT` (full attention + Mamba, B=16, one new token)."""
    rows = [
        {"layout": "full+mamba", "figure": "peak", "external": 1024}
        | {"loaded": 1024, "blocks": [65, mamba_blocks]},
        {"layout": "full+mamba", "figure": "longest_hit", "value": longest},
        {"layout": "full+mamba", "figure": "concurrent", "external": 8192}
        | {"value": concurrent},
    ]
    return {"block_size": B, "new_tokens": 1, "num_blocks": 4096} | {
        "shared_prefix": 8192,
        "rows": rows,
    }


def test_layout_figures_of_a_mamba_hybrid():
    """A Mamba group at the physical limit holds the state block of the last
    external token and the block of the new one, 2 for any hit; with a block
    per token (0.13.0) the budget of 4096 blocks admits half the hit and 3
    instead of 7 requests with an 8k hit."""
    for L in (1024, 8192, 32768):
        assert figures.layout_group_blocks("mamba", L, 1, B, True) == 2
        assert figures.layout_group_blocks("mamba", L, 1, B, False) == L // B + 1
        assert figures.layout_group_blocks("full", L, 1, B, True) == L // B + 1
    kinds = ["full", "mamba"]
    assert figures.layout_admission(kinds, B, 1, 4096, 8192, True) == (65472, 7)
    assert figures.layout_admission(kinds, B, 1, 4096, 8192, False) == (32736, 3)


def test_layout_memory_checks_the_declaring_stage_at_the_physical_limit(
    monkeypatch, project
):
    """A layout of ``[[bench.layouts]]`` is checked at the physical limit from
    the stage that declares it on and at a block per token at the base; the
    stage before it is reported. Each figure carries its ratio to the base's,
    and the report decodes as its schema. A tree of the declaring stage whose
    Mamba group holds a block per token fails the check (the witness)."""
    (project.patches / "02-second" / "stage.toml").write_text(TAG + MAMBA_LAYOUT)
    outputs = {
        "base": _layout_output(65, 32736, 3),
        "stage 01": _layout_output(65, 32736, 3),
        "stage 02": _layout_output(2, 65472, 7),
    }
    monkeypatch.setattr(
        figures,
        "_run_each",
        lambda cfg, pyenv, trees, name, args: (
            {t.label: [outputs[t.label]] for t in trees},
            {},
        ),
    )
    trees = [
        bench_trees.BenchTree("base", None, stage=0),
        bench_trees.BenchTree("stage 01", None, stage=1),
        bench_trees.BenchTree("stage 02", None, stage=2),
    ]
    report = figures.bench_layouts(project, None, trees, bench.QUICK)
    assert report["checked"] == "exact", report["mismatches"]
    assert "full+mamba (full + mamba) from stage 02" in report["method"]
    scenario = next(s for s in bench.SCENARIOS if s.name == "layout_memory")
    encoded = bench.encode(scenario, report)
    assert isinstance(encoded, figures.LayoutReport)
    # The site's headline: the base against the last stage, with the limit.
    headline = site_bench.layouts_headline(encoded)
    assert "(base → stage 02, budget 4096 blocks)" in headline
    assert "peak, group 1 (mamba) (L 1,024): 65 → 2 (limit 2)" in headline
    assert "requests admitted together (L 8,192): 3 → 7 (limit 7)" in headline
    by = {(r["tree"], r["figure"]): r for r in report["rows"]}
    mamba = by[("stage 02", "peak, group 1 (mamba)")]
    assert (mamba["value"], mamba["physical"], mamba["/base"]) == (2, 2, 0.031)
    assert by[("stage 02", "longest hit")]["/base"] == 2.0
    assert by[("stage 02", "requests admitted together")]["/base"] == 2.333
    assert by[("base", "peak, group 1 (mamba)")]["checked"] == "every block"
    assert by[("stage 01", "peak, group 1 (mamba)")]["checked"] == "-"
    assert "|peak, group 1 (mamba)|1024|2|65|65 (x1.0)|2 (x0.031)|" in _cells(
        bench_tables.summary_markdown({"layout_memory": report})
    )

    outputs["stage 02"] = _layout_output(65, 32736, 3)
    report = figures.bench_layouts(project, None, trees, bench.QUICK)
    assert report["checked"] == "MISMATCH"
    assert report["mismatches"] == [
        "stage 02: full+mamba peak, group 1 (mamba) L=1024: 65 (want 2, physical)",
        "stage 02: full+mamba longest hit: 32736 (want 65472, physical)",
        "stage 02: full+mamba requests admitted together L=8192: 3 (want 7, physical)",
    ]
