"""The real-engine throughput benchmark's host side: plans, figures, verdicts.

The engine runs themselves belong to `hmastack bench --throughput` (minutes of
engine processes, not `make test`); here the pure parts, on run results shaped
as `hmastack_testkit.e2e.throughput` writes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from hmastack_testkit.e2e.models import MODELS

from hmastack.bench import plots as bench_plots
from hmastack.bench import run as bench
from hmastack.bench import throughput as bt
from hmastack.bench import throughput_nixl as bn
from hmastack.core.errors import HmastackError
from hmastack.site import docs
from hmastack.stack import series

from .conftest import TAG

ROOT = Path(__file__).resolve().parents[2]


def _run(seconds: float, running: int, steps: int, blocks: list[int], groups: int):
    return {
        "completed": 16,
        "seconds": seconds,
        "cpu_seconds": seconds,
        "steps": steps,
        "max_running": running,
        "preemptions": 0,
        "peak_total_blocks": [b * running for b in blocks],
        "peak_request_blocks": blocks,
        "groups": ["g"] * groups,
        "num_blocks": 240 if groups == 1 else 1440,
        "batch": bt.BATCH,
        "cached_tokens": [1024],
        "load_seconds": 1.0,  # the same block files read in every tree
        "step_seconds_median": 0.005 if groups == 1 else 0.006,
    }


def _runs(base_s: list[float], tree_s: list[float], case="memory-bound"):
    return {
        (case, "stage 0"): [_run(s, 3, 200, [67], 1) for s in base_s],
        (case, "stage 3"): [_run(s, 16, 40, [67, 4, 4, 4, 4, 4], 6) for s in tree_s],
    }


def test_plans_base_hma_off_plain_connector_series_hma_on(project):
    base = bt.plan("memory-bound", False, Path("/m"), Path("/s"))
    series_plan = bt.plan("memory-bound", True, Path("/m"), Path("/s"))
    assert (base["hma"], base["connector"]) == (False, "plain")
    assert (series_plan["hma"], series_plan["connector"]) == (True, "hma")
    # The same memory: blocks of one layer (the engine divides by the layers a
    # block holds, models.ModelSpec.num_blocks).
    assert base["pool_layer_blocks"] == series_plan["pool_layer_blocks"] == 1440
    # The trees: the stages whose [bench] throughput names the set, HMA on
    # from the stage whose hma names the test connector.
    (project.patches / "01-first" / "stage.toml").write_text(
        TAG + '[bench]\nthroughput = ["full"]\n'
    )
    (project.patches / "02-second" / "stage.toml").write_text(
        TAG + 'hma = ["test"]\n[bench]\nthroughput = ["quick", "full"]\n'
    )
    stages = series.everything(project)
    assert bt.trees(stages, quick=True) == {"base": (0, False), "stage 02": (2, True)}
    assert bt.trees(stages, quick=False) == {
        "base": (0, False),
        "base (HMA on)": (0, True),
        "stage 01": (1, False),
        "stage 02": (2, True),
    }
    spec = MODELS[bt.MODEL]
    assert spec.num_layers == bt.LAYERS
    assert spec.num_blocks(bt.MEMORY_BOUND_LAYER_BLOCKS, False) == 240
    assert spec.num_blocks(bt.CONTROL_LAYER_BLOCKS, False) == 1200


def test_the_budgets_bound_the_base_and_not_the_control():
    """From the block counts alone: a request of the batch holds ceil(1096/16)
    = 69 blocks at the end with HMA off; 3 fit in the memory-bound pool, all 16
    in the control pool."""
    tokens = bt.BATCH["prefix"] + bt.BATCH["suffix"] + bt.BATCH["max_tokens"]
    per_request = -(-tokens // 16)
    assert per_request == 69
    assert bt.predicted_concurrency(240, per_request, 16) == 3
    assert bt.predicted_concurrency(1200, per_request, 16) == 16
    assert bt.predicted_concurrency(1100, per_request, 16) == 15
    # The series: 69 full-attention blocks and 3 per sliding-window group.
    assert bt.predicted_concurrency(1440, 69 + 5 * 3, 16) == 16
    assert bt.predicted_concurrency(1440, 0, 16) == 16


def test_summary_ratio_per_round_and_verdict():
    runs = _runs([8.0, 10.0, 9.0], [2.0, 2.0, 3.0])
    rows = bt.summarize(runs, ["stage 0", "stage 3"])
    base, tree = rows
    assert base["ratio median"] == 1.0
    # per round: 4.0, 5.0, 3.0
    assert (tree["ratio median"], tree["ratio min"], tree["ratio max"]) == (4, 3, 5)
    assert tree["req/s median"] == 8.0
    assert base["peak layer blocks"] == 6 * 3 * 67  # HMA off: a block holds 6 layers
    assert tree["peak layer blocks"] == 16 * 87
    assert base["predicted running"] == 3 and tree["predicted running"] == 16
    v = bt.judge(rows, ["stage 0", "stage 3"])["memory-bound: stage 3"]
    assert v["predicted admitted ratio"] == round(16 / 3, 3)
    assert v["admitted (base → tree)"] == "3 → 16"
    assert v["steps ratio (base / tree)"] == 5.0
    assert v["at least predicted"] is False  # 4.0 < 5.33
    assert "4.00x" in bt.headline({"memory-bound: stage 3": v}, 3)
    # Without the loads (1 s each) the rest shrinks 8/1 = 8x (medians 9 s, 2 s).
    assert v["ratio without loads"] == 8.0
    # The verdict has every field of its schema, the load-free ones included.
    typed = msgspec.convert(v, bt.Verdict)
    assert typed.ratio_without_loads == 8.0 and typed.step_s == [0.005, 0.006]
    why = bt.explanation({"memory-bound: stage 3": v})
    assert "below the 5.33x" in why and "1.00 CPU s of the base's 9.00 s" in why
    assert "5.00x fewer engine steps" in why and "6.0 ms against 5.0 ms" in why
    v["at least predicted"] = True
    assert bt.explanation({"memory-bound: stage 3": v}) == ""
    why = bt.explanation({"control: stage 3": v})
    assert "6.0 CPU ms against the base's 5.0" in why


def test_a_failed_run_drops_out_of_the_ratios():
    runs = _runs([8.0, 10.0], [2.0, 2.0])
    runs[("memory-bound", "stage 3")][1] = {"error": "boom"}
    rows = bt.summarize(runs, ["stage 0", "stage 3"])
    assert rows[1]["rounds"] == 1 and rows[1]["ratio median"] == 4.0


def test_cached_token_mismatch_fails_timing_never():
    assert bt.failed({"mismatches": ["memory-bound stage 0: req-1: 0 cached"]})
    assert bt.failed({"rows": [{"ratio median": 0.1}], "mismatches": []}) == []


def test_throughput_runs_only_when_asked_for():
    default = bench.selected_scenarios(None, throughput=False)
    assert "throughput" not in default and "scheduler_instructions" in default
    assert bench.selected_scenarios(None, throughput=True)[-2:] == (
        "throughput",
        "throughput_nixl",
    )
    assert "throughput_nixl" not in default
    assert bench.selected_scenarios("throughput", throughput=False) == ("throughput",)
    with pytest.raises(HmastackError, match="unknown scenario nope"):
        bench.selected_scenarios("nope", throughput=False)


def test_plot_draws_the_three_panels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs([8.0, 10.0], [2.0, 2.5]) | _runs([2.0, 2.1], [2.0, 2.0], "control")
    report = {
        "rows": bt.summarize(runs, ["stage 0", "stage 3"]),
        "cases": bt.CASES,
        "batch": bt.BATCH,
    }
    fig = bench_plots.plot_throughput(report, plt)
    assert len(fig.axes) == 3
    plt.close(fig)


def test_the_page_shows_the_throughput_headline_plot_and_verdict(project):
    out = project.reports / "bench"
    out.mkdir(parents=True)
    runs = _runs([8.0, 10.0], [2.0, 2.5]) | _runs([2.0, 2.1], [2.0, 2.0], "control")
    rows = bt.summarize(runs, ["stage 0", "stage 3"])
    verdicts = bt.judge(rows, ["stage 0", "stage 3"])
    report = {
        "title": "Real-engine throughput under a KV budget",
        "method": "the method",
        "rows": rows,
        "cases": bt.CASES,
        "batch": bt.BATCH,
        "verdicts": verdicts,
        "rounds": 2,
        "headline": bt.headline(verdicts, 2),
        "explanation": bt.explanation(verdicts),
        "mismatches": [],
        "errors": {},
        "runs": {f"{c} / {t}": rs for (c, t), rs in runs.items()},
    }
    (out / "throughput.json").write_text(json.dumps(report))
    bench.plot("throughput", report, out)
    page = docs.generate(project).pages["benchmarks.md"]
    head = page[page.index("## Headline") : page.index("## Plots")]
    assert "**Throughput**: memory-bound: stage 3: 4.00x" in head
    assert "not measured yet" not in head
    plots = page[page.index("## Plots") : page.index("## Real-engine throughput")]
    assert "![throughput](assets/bench/throughput.png)" in plots
    section = page[page.index("## Real-engine throughput") : page.index("## Method")]
    cells = re.sub(r" *\| *", "|", section)
    row = "|memory-bound: stage 3|4.000 (4.000-4.000)|4.000 (4.000-4.000)|3 → 16|5.333|"
    assert row + "5.000|no|" in cells
    assert "|control: stage 3|" in cells
    assert "below the 5.33x" in section  # the explanation


# --- P/D with NixlConnector (throughput_nixl) ----------------------------------

GEMMA = ["SlidingWindowSpec(32)"] * 5 + ["FullAttentionSpec"]
GPT_OSS = ["SlidingWindowSpec(32)", "FullAttentionSpec"]


def test_nixl_prediction_full_attention_whole_prompt_sliding_window_its_window():
    """A request holds 1032 + 64 - 1 = 1095 tokens at its last step: 69 blocks
    with full attention and with HMA off, ceil(31/16) + 1 = 3 per sliding-window
    group (W=32)."""
    tokens = bn.tokens_held(bt.BATCH)
    assert tokens == 1095
    assert bn.predicted_blocks(["FullAttentionSpec"], tokens, 16) == [69]
    assert bn.predicted_blocks(GEMMA, tokens, 16) == [3, 3, 3, 3, 3, 69]
    assert bn.predicted_blocks(GPT_OSS, tokens, 16) == [3, 69]
    assert bn.predicted_blocks(["ChunkedLocalAttentionSpec(32)"], 20, 16) == [2]
    # HMA off: the one group's spec keeps the sliding layers' window, its
    # blocks hold every token
    assert bn.predicted_blocks(["FullAttentionSpec(32)"], tokens, 16) == [69]


def _pd_run(groups: list[str], measured: list[int], free: int, running: int) -> dict:
    return {
        **_run(2.0, running, 100, measured, len(groups)),
        "groups": groups,
        "num_blocks": free,
        "cached_tokens": [1031],
        "nixl_blocks_read": 1040,
        "failed_loads": 0,
        "producer_blocks_held_after_read": 0,
    }


def test_nixl_a_wrong_prediction_fails_the_command():
    """The witness of the prediction check: a measured peak that is not the
    layout's (a sliding-window group holding the whole prompt, as with the
    window ignored) fails the command; the right one does not."""
    right = {
        ("Gemma-3-like memory-bound", "stage 6"): [
            _pd_run(GEMMA, [3] * 5 + [69], 1439, 16)
        ]
    }
    assert bn.prediction_mismatches(right) == []
    assert bn.failed({"prediction_mismatches": bn.prediction_mismatches(right)}) == []
    wrong = {
        ("Gemma-3-like memory-bound", "stage 6"): [_pd_run(GEMMA, [69] * 6, 1439, 3)]
    }
    (msg,) = bn.prediction_mismatches(wrong)
    assert "predicted [3, 3, 3, 3, 3, 69]" in msg
    assert bn.failed({"prediction_mismatches": [msg]}) == [msg]
    # HMA off: one group whose spec keeps the window, every token's block
    off = {
        ("Gemma-3-like control", "stage 0"): [
            _pd_run(["FullAttentionSpec(32)"], [69], 1199, 16)
        ]
    }
    assert bn.prediction_mismatches(off) == []


def test_nixl_a_preempted_run_is_checked_in_its_full_attention_groups():
    """A preempted request computes its prompt again in one chunk: its
    sliding-window group holds the chunk's blocks in that step. Such a run is
    checked in the full-attention groups only, and still fails there."""
    run = _pd_run(GPT_OSS, [65, 69], 479, 7)
    run["preemptions"] = 1
    case = ("gpt-oss-like memory-bound", "stage 6")
    assert bn.prediction_mismatches({case: [run]}) == []
    run["peak_request_blocks"] = [65, 70]
    assert bn.prediction_mismatches({case: [run]})
    run["preemptions"] = 0
    run["peak_request_blocks"] = [65, 69]
    assert bn.prediction_mismatches({case: [run]})


def test_nixl_a_producer_holding_blocks_or_an_error_fails_timing_never():
    runs = {
        ("gpt-oss-like control", "stage 0"): [
            _pd_run(["FullAttentionSpec"], [69], 1199, 16)
        ]
    }
    assert bn.pair_leaks(runs, 3) == []
    runs[("gpt-oss-like control", "stage 0")][0]["producer_blocks_held_after_read"] = 5
    assert bn.pair_leaks(runs, 3) == [
        "gpt-oss-like control stage 0: the producer holds 5 blocks after the read"
    ]
    # 0.13.0's idle producer keeps them (reported, not checked)
    runs[("gpt-oss-like control", "stage 0")][0]["stage"] = 0
    assert bn.pair_leaks(runs, 3) == []
    # No stage names the check: nothing is checked.
    runs[("gpt-oss-like control", "stage 0")][0]["stage"] = 4
    assert bn.pair_leaks(runs, None) == []
    assert bn.pair_leaks(runs, 3)
    assert bn.failed({"errors": {"stage 6": "control round 0: boom"}})
    assert bn.failed({"rows": [{"ratio median": 0.1}]}) == []


def test_nixl_pair_plans_same_layout_both_sides_budget_on_the_consumer():
    case = "gpt-oss-like memory-bound"
    prod = bn.plan(case, True, Path("/m"), Path("/f"), 1, "producer")
    cons = bn.plan(case, True, Path("/m"), Path("/f"), 2, "consumer")
    assert prod["model"] == cons["model"] == "gemma-1to1"
    assert prod["connector"] == cons["connector"] == "nixl"
    assert prod["hma"] is cons["hma"] is True
    assert cons["pool_layer_blocks"] == bt.MEMORY_BOUND_LAYER_BLOCKS
    assert prod["pool_layer_blocks"] == bn.PRODUCER_LAYER_BLOCKS
    assert prod["store_dir"] == cons["store_dir"]  # the pair's files
    assert (prod["role"], cons["role"]) == ("producer", "consumer")
    assert set(bn.CASES) == {
        f"{lay} {c}" for lay in ("Gemma-3-like", "gpt-oss-like") for c in bt.CASES
    }


def test_nixl_trees_are_the_base_and_the_stage_that_turns_hma_on(project):
    with pytest.raises(HmastackError, match="no stage turns HMA on"):
        bn.trees(series.everything(project))
    (project.patches / "02-second" / "stage.toml").write_text(TAG + 'hma = ["nixl"]\n')
    trees = bn.trees(series.everything(project))
    assert trees == [
        ("base", 0, False),
        ("stage 02", 2, True),
        ("stage 02 (HMA off)", 2, False),
    ]
    assert bn.witness([t[0] for t in trees]) == "stage 02 (HMA off)"


def test_nixl_predictions_put_the_layout_beside_the_engine():
    rows_runs = {
        ("Gemma-3-like memory-bound", "stage 0"): [
            _pd_run(["FullAttentionSpec"], [69], 239, 3)
        ],
        ("Gemma-3-like memory-bound", "stage 6"): [
            _pd_run(GEMMA, [3] * 5 + [69], 1439, 16)
        ],
    }
    rows = bt.summarize(rows_runs, ["stage 0", "stage 6"], bn.CASES)
    pred = bn.predictions(rows, rows_runs)
    # The writer gives every field of the schema the site reads.
    typed = msgspec.convert(pred, dict[str, bn.Prediction])
    assert typed["Gemma-3-like memory-bound: stage 0"].at_once_predicted == 3
    assert msgspec.convert(rows, list[bt.ThroughputRow])[1].tree == "stage 6"
    base = pred["Gemma-3-like memory-bound: stage 0"]
    assert base["requests at once (predicted)"] == 3  # 239 // 69
    tree = pred["Gemma-3-like memory-bound: stage 6"]
    assert tree["requests at once (predicted)"] == 16  # 1439 // 84, max_num_seqs
    assert tree["blocks per request (measured)"] == [3] * 5 + [69]
    # a preemption's inflated peak does not enter the predicted ratio
    rows_runs[("Gemma-3-like memory-bound", "stage 6")][0]["peak_request_blocks"] = [
        65
    ] * 5 + [69]
    rows = bn.with_layout_prediction(
        bt.summarize(rows_runs, ["stage 0", "stage 6"], bn.CASES), rows_runs
    )
    assert [r["predicted running"] for r in rows] == [3, 16]
    verdicts = bt.judge(rows, ["stage 0", "stage 6"], bn.CASES)
    assert "Gemma-3-like memory-bound: stage 6" in bn.headline(verdicts, 1)
    why = bn.explanation(verdicts)
    assert "requests at once 3 → 16 (predicted 5.33x)" in why
    assert "a median step 6.0 CPU ms against the base's 5.0" in why
