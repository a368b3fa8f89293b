"""hmastack bench: the expected figures, and the deterministic scenarios run in
the real stage trees (skipped with a reason when build/env or a tree is missing)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hmastack import bench
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


def test_parse_stages():
    cfg = config_mod.load(ROOT)
    assert bench.parse_stages(None, cfg) == list(range(1, cfg.num_stages + 1))
    assert bench.parse_stages(None, cfg, quick=True) == [cfg.num_stages]
    assert bench.parse_stages("0,1-3", cfg) == [1, 2, 3]


def test_register_adds_bench_command():
    from hmastack.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--stages", "3", "--no-peer"])
    assert args.quick and args.no_peer and args.stages == "3"


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
