"""Benchmarks: what the series changes in memory, admission and scheduler cost.

``hmastack bench [--quick] [--stages 1-3] [--no-peer] [--no-instructions]`` runs
the scenarios of :data:`SCENARIOS` (scripts in ``bench/scenarios/``), each INSIDE
one vLLM tree's process (``bench_trees``), on the base (stage 0), on each
selected stage and on the vLLM 0.14.0 peer, alternating trees:

1. ``peak_blocks``: peak blocks per KV cache group for one request with an
   external hit of L tokens, against the physical minimum ceil((W-1)/B)+1 per SWA
   group. Deterministic: checked exactly (a mismatch fails the command).
2. ``admission``: the longest external hit admitted and the number of concurrent
   requests with a long external prefix under a fixed KV budget, with HMA off and
   on, against the physical limit. Deterministic, checked exactly.
3. ``scheduler_instructions``: instructions per schedule()+update_from_output()
   step counted by callgrind, per KV cache layout (full attention, Gemma-3-like,
   gpt-oss-like), connector, mode and request count, as the ratio stage/base with
   the run-to-run spread; per commit of a stage with several (full set); the rows
   above 1.01 get a profile; a slowed copy of the last stage is the witness that
   it bites (a missed witness fails the command). ``bench_cost``.
4. ``scheduler_cost``: CPU time of the same calls, noisy, beside the counts.
5. ``eagle_hits``: the prefix cache hit (tokens) of a request whose prompt was
   cached (fully, evicted in one group, loaded by a KV connector), with eagle on
   and off. Checked exactly from stage 5 on against the rule
   (:func:`expected_eagle_hit`); earlier trees and the peer are reported.

Results: ``build/reports/bench/<scenario>.json``, ``summary.md`` (tables), one
``<scenario>.png`` plot each and the tables on the terminal; the site's
Benchmarks page (``site_bench``) shows them. Method and limits:
``bench/README.md``. A further scenario plugs in as one more :class:`Scenario`
in :data:`SCENARIOS`.

Optional (``--throughput``, ``--only throughput``; in ``hmastack run``, not in
``make test``): ``throughput``, the real engine (``build/e2e-env``) serving a
batch whose long prefixes come from a KV connector under a memory-bound and a
control KV budget, base (HMA off) against stages 3/4 (``bench_throughput``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from hmastack.bench import callgrind
from hmastack.bench import cost as bench_cost
from hmastack.bench import throughput as bench_throughput
from hmastack.bench.trees import (
    PEER_LABEL,
    BenchTree,
    alternate,
    commit_trees,
    parse_stages,
    peer_tree,
    run_scenario,
    slowed_tree,
    stage_tree,
)
from hmastack.core import config as config_mod
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console, step
from hmastack.stack import env as env_mod

SUMMARY = "summary.md"  # the results as Markdown tables, one column per tree

FULL = {
    "lengths": [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
    "windows": [512, 4096],
    "patterns": ["gemma3", "gptoss"],
    "cost": {"settings": bench_cost.ALL_SETTINGS, "steps": 30, "reps": 3},
    "counts": {
        "settings": bench_cost.ALL_SETTINGS,
        "steps": 6,
        "reps": 1,
        # One more round of the base and the last stage: the spread.
        "repeat_rounds": 1,
        "repeat_trees": 2,
        "witness_settings": [s for s in bench_cost.ALL_SETTINGS if s["requests"] == 64],
    },
    "commits": True,
    "peer_cost": True,
}
QUICK = {
    "lengths": [1024, 8192, 131072],
    "windows": [512, 4096],
    "patterns": ["gemma3", "gptoss"],
    "cost": {"settings": bench_cost.QUICK_SETTINGS, "steps": 10, "reps": 1},
    "counts": {
        "settings": bench_cost.QUICK_SETTINGS,
        "steps": 6,
        "reps": 1,
        # One more round of the base: the spread.
        "repeat_rounds": 1,
        "repeat_trees": 1,
        "witness_settings": bench_cost.WITNESS_QUICK,
    },
    "commits": False,
    "peer_cost": False,
}


@dataclass
class Context:
    """What a scenario runs with: the configuration, the environment, the trees
    (base first), the plan (:data:`FULL` or :data:`QUICK`)."""

    cfg: Config
    pyenv: env_mod.Env
    trees: list[BenchTree]
    plan: dict
    quick: bool
    # The marker and the fork server of the instruction counts (None: skipped).
    counting: tuple | None = None
    # The scenarios to run (names); the real-engine throughput only on request.
    selected: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scenario:
    """One benchmark: ``run`` returns its report (a dict with ``title``,
    ``rows``, ``errors`` and, for deterministic figures, ``checked``); ``plot``
    draws it (or None); ``failed`` says whether the report fails the command."""

    name: str
    run: Callable[[Context], dict]
    plot: Callable | None = None
    failed: Callable[[dict], list[str]] = lambda report: []


# --- the expected figures ---------------------------------------------------------


def expected_swa_blocks(
    external: int, new: int, window: int, block_size: int, separate: bool
) -> int:
    """Blocks one SWA group holds right after admitting the request.

    Through ``num_new_tokens`` (0.13.0, stages < 3): every token gets a block.
    With external tokens passed separately: the skipped prefix
    (max(0, L - W + 1) tokens, L computed before the step) is the null block.
    """
    total = math.ceil((external + new) / block_size)
    if not separate:
        return total
    skipped = max(0, min(external, external + new - 1) - window + 1)
    return total - skipped // block_size


def check_peak(report: dict) -> list[str]:
    """The mismatches between a tree's peak-blocks report and the formulas."""
    bad = []
    B, sep = report["block_size"], report["separate_external_arg"]
    for r in report["rows"]:
        want_full = math.ceil((r["external"] + r["new"]) / B)
        want_swa = expected_swa_blocks(r["external"], r["new"], r["window"], B, sep)
        if (r["full_blocks"], r["swa_blocks"]) != (want_full, want_swa):
            bad.append(
                f"{r['pattern']} W={r['window']} L={r['external']}: full "
                f"{r['full_blocks']} (want {want_full}), swa {r['swa_blocks']} "
                f"(want {want_swa})"
            )
    return bad


GROUPS = {"gemma3": 6, "gptoss": 2}  # KV cache groups of each pattern
# The group kinds of each pattern, in order (as bench/scenarios/_common.py).
GROUP_KINDS = {"gemma3": ["full"] + ["swa"] * 5, "gptoss": ["full", "swa"]}


def expected_admission(
    groups: int, separate: bool, B: int, n: int, N: int, prefix: int
) -> dict[str, int] | None:
    """Admission figures that follow from the block counts alone (one null
    block reserved): HMA off is one group of N // groups blocks; HMA on without
    the separate external argument gives every group a block per token. With it
    the figures are the physical limits, which the scenario computes (None)."""
    per_req = math.ceil((prefix + n) / B)
    off = N // groups - 1
    out = {
        "longest_hit_hma_off": off * B - n,
        "concurrent_hma_off": off // per_req,
    }
    if not separate:
        out["longest_hit"] = ((N - 1) // groups) * B - n
        out["concurrent"] = (N - 1) // (groups * per_req)
    return out


def check_admission(report: dict, args: dict) -> list[str]:
    """The mismatches between a tree's admission report and the block counts."""
    bad = []
    B, n = args["block_size"], args["new_tokens"]
    N, prefix = args["num_blocks"], args["shared_prefix"]
    sep = report["separate_external_arg"]
    for r in report["rows"]:
        want = expected_admission(GROUPS[r["pattern"]], sep, B, n, N, prefix)
        if sep:
            want["longest_hit"] = r["longest_hit_physical"]
            want["concurrent"] = r["concurrent_physical"]
        for key, value in want.items():
            if r[key] != value:
                bad.append(
                    f"{r['pattern']} W={r['window']}: {key} {r[key]} (want {value})"
                )
    return bad


def _run_each(cfg, pyenv, trees, name, args):
    return alternate(trees, 1, lambda t, _: run_scenario(cfg, pyenv, t, name, args))


# --- prefix cache hits with eagle (stage 5) ---------------------------------------

# The first stage whose prefix cache hits follow the eagle rule
# (patches/05-eagle-hits); its hits are checked exactly, earlier trees and the
# peer are reported.
EAGLE_RULE_STAGE = 5
EAGLE_WINDOWS = [128, 512]


def eagle_first_cached_block(kind: str, window: int, B: int, row: dict) -> int:
    """The first block of the first request's prompt that a group holds in the
    prefix cache on a tree with the eagle rule: all of them, except after a
    connector load in a sliding window group, which allocated (and cached)
    only the window of the first computed token, x = min(external, prompt - 1)
    (stage 3)."""
    if kind == "full" or not row.get("load"):
        return 0
    x = min(row["external"], row["prompt"] - 1)
    return max(0, x - window + 1) // B


def expected_eagle_hit(kinds: list[str], window: int, B: int, row: dict) -> int:
    """The longest hit (tokens) of a second request with the same prompt by the
    rule, trying every length: L + B <= prompt - 1, and every group holds its
    blocks for L (full attention: 0 ~ L/B - 1; sliding window: the window of
    token L) and block L/B, which eagle computes again."""
    max_len = row["prompt"] - 1
    evicted = {tuple(e) for e in row.get("evict", [])}

    def cached(group: int, kind: str, block: int) -> bool:
        return (
            (block + 1) * B <= max_len
            and block >= eagle_first_cached_block(kind, window, B, row)
            and (group, block) not in evicted
        )

    def serves(L: int) -> bool:
        for group, kind in enumerate(kinds):
            first = 0 if kind == "full" else max(0, L - window + 1) // B
            if not all(cached(group, kind, b) for b in range(first, L // B + 1)):
                return False
        return True

    return max([0] + [L for L in range(B, max_len + 1, B) if serves(L)])


def tree_stage(label: str) -> int | None:
    """``"stage 5"`` -> 5; the peer -> None."""
    kind, _, num = label.partition(" ")
    return int(num) if kind == "stage" and num.isdigit() else None


def bench_eagle(cfg, pyenv, trees, plan) -> dict:
    B = 16
    args = {"patterns": plan["patterns"], "windows": EAGLE_WINDOWS, "block_size": B}
    results, errors = _run_each(cfg, pyenv, trees, "eagle_hits", args)
    rows, mismatches = [], []
    for label, runs in results.items():
        stage = tree_stage(label)
        checked = stage is not None and stage >= EAGLE_RULE_STAGE
        for r in runs[0]["rows"] if runs else []:
            kinds = GROUP_KINDS[r["pattern"]]
            rule = expected_eagle_hit(kinds, r["window"], B, r)
            if checked and r["hit"] != rule:
                mismatches.append(
                    f"{label}: {r['pattern']} W={r['window']} {r['case']}: hit "
                    f"{r['hit']} (want {rule})"
                )
            rows.append(
                {
                    "tree": label,
                    "pattern": r["pattern"],
                    "W": r["window"],
                    "case": r["case"],
                    "prompt": r["prompt"],
                    "hit (eagle)": r["hit"],
                    # A connector's cache contents depend on the tree's allocation.
                    "rule": rule if checked or not r.get("load") else "-",
                    "hit without eagle": r["hit_no_eagle"],
                }
            )
    return {
        "title": "Prefix cache hits with eagle (tokens)",
        "method": "a prompt computed (or loaded by a KV connector first) and "
        "freed, blocks evicted from one group, then the same prompt's prefix "
        "cache hit (get_computed_blocks) with eagle on and off; B=16; 'rule': the "
        f"longest hit by the rule, checked exactly from stage {EAGLE_RULE_STAGE} on",
        "checked": "exact" if not mismatches else "MISMATCH",
        "mismatches": mismatches,
        "errors": errors,
        "rows": rows,
    }


# --- the scenarios ----------------------------------------------------------------


def bench_peak(cfg, pyenv, trees, plan) -> dict:
    args = {k: plan[k] for k in ("lengths", "windows", "patterns")} | {
        "block_size": 16,
        "new_tokens": 1,
    }
    results, errors = _run_each(cfg, pyenv, trees, "peak_blocks", args)
    rows, mismatches = [], []
    for label, runs in results.items():
        if not runs:
            continue
        rep = runs[0]
        mismatches += [f"{label}: {m}" for m in check_peak(rep)]
        for r in rep["rows"]:
            rows.append(
                {
                    "tree": label,
                    "pattern": r["pattern"],
                    "W": r["window"],
                    "L": r["external"],
                    "full": r["full_blocks"],
                    "swa/group": r["swa_blocks"],
                    "swa groups": r["swa_groups"],
                    "swa min": r["swa_min"],
                    "swa/min": round(r["swa_blocks"] / r["swa_min"], 2),
                    "pool blocks": r["pool_taken"],
                    "external arg": rep["separate_external_arg"],
                }
            )
    return {
        "title": "Peak blocks per group for one external hit",
        "method": "one new request of L+1 tokens, L external; blocks held right "
        "after allocate_slots (before remove_skipped_blocks); B=16",
        "block_size": 16,
        "checked": "exact" if not mismatches else "MISMATCH",
        "mismatches": mismatches,
        "errors": errors,
        "rows": rows,
    }


def bench_admission(cfg, pyenv, trees, plan) -> dict:
    args = {
        "windows": plan["windows"],
        "patterns": plan["patterns"],
        "block_size": 16,
        "new_tokens": 1,
        "num_blocks": 4096,
        "shared_prefix": 8192,
    }
    results, errors = _run_each(cfg, pyenv, trees, "admission", args)
    rows, mismatches = [], []
    for label, runs in results.items():
        if runs:
            mismatches += [f"{label}: {m}" for m in check_admission(runs[0], args)]
        for r in runs[0]["rows"] if runs else []:
            rows.append(
                {
                    "tree": label,
                    "pattern": r["pattern"],
                    "W": r["window"],
                    "longest hit": r["longest_hit"],
                    "HMA off": r["longest_hit_hma_off"],
                    "physical": r["longest_hit_physical"],
                    "concurrent@8k": r["concurrent"],
                    "conc. HMA off": r["concurrent_hma_off"],
                    "conc. physical": r["concurrent_physical"],
                }
            )
    return {
        "title": "Admission under a fixed KV budget",
        "method": "budget 4096 hybrid blocks (B=16); HMA off = one group holding "
        "every layer (4096 // groups blocks); binary search over L with a fresh "
        "KVCacheManager per probe; concurrent = requests with an 8k external "
        "prefix admitted in one step",
        "budget_blocks": 4096,
        "checked": "exact" if not mismatches else "MISMATCH",
        "mismatches": mismatches,
        "errors": errors,
        "rows": rows,
    }


def run_cpu_time(ctx: Context) -> dict:
    trees = ctx.trees
    if not ctx.plan["peer_cost"]:  # CI time budget: the peer's timings are not quick
        trees = [t for t in trees if t.label != PEER_LABEL]
    return bench_cost.cpu_time(ctx.cfg, ctx.pyenv, trees, ctx.plan["cost"])


def count_trees(ctx: Context) -> list[BenchTree]:
    """The trees whose instructions are counted: the base, each stage preceded by
    its partial commits (full set), the peer (full set)."""
    stages = [t for t in ctx.trees if t.label != PEER_LABEL]
    out = [stages[0]]
    commits = {}
    if ctx.plan["commits"]:
        numbers = [int(t.label.split()[1]) for t in stages[1:]]
        for t in commit_trees(ctx.cfg, numbers):
            commits.setdefault(t.label.split()[1].split(".")[0], []).append(t)
    for t in stages[1:]:
        out += commits.get(t.label.split()[1], [])
        out.append(t)
    if ctx.plan["peer_cost"]:
        out += [t for t in ctx.trees if t.label == PEER_LABEL]
    return out


def run_instructions(ctx: Context) -> dict:
    if ctx.counting is None:
        return {
            "title": "Scheduler instructions per step",
            "skipped": "--no-instructions",
            "errors": {},
            "rows": [],
        }
    cg, server = ctx.counting
    trees = count_trees(ctx)
    stages = [t for t in ctx.trees if t.label.startswith("stage ")]
    last = stages[-1]
    plan = {**ctx.plan["counts"]}
    plan["repeat"] = [stages[0].label, last.label][: plan.get("repeat_trees", 2)]
    witness = None
    if last is not stages[0]:
        k = int(last.label.split()[1])
        slowed = slowed_tree(ctx.cfg, k, bench_cost.SLOWDOWN)
        witness = bench_cost.Witness(slowed, last)
    return bench_cost.instruction_counts(
        ctx.cfg, ctx.pyenv, trees, plan, cg, server, witness
    )


def _memory_failed(report: dict) -> list[str]:
    return list(report.get("mismatches", []))


def _count_failed(report: dict) -> list[str]:
    w = report.get("witness")
    if w is not None and not w.get("caught"):
        return [f"the witness {w['tree']} was not caught: {w.get('why')}"]
    return []


# --- output ------------------------------------------------------------------------


def print_table(report: dict) -> None:
    from rich.table import Table

    rows = report.get("rows", [])
    table = Table(title=report["title"])
    cols = (
        [
            c
            for c in dict.fromkeys(k for r in rows for k in r)
            if not isinstance(rows[0].get(c), dict | list)
        ]
        if rows
        else []
    )
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in cols))
    console.print(table)
    for label, why in report.get("errors", {}).items():
        console.print(f"[red]{label} failed:[/red] {why}")


MARKERS = "osD^vP*X"


# matplotlib's default colour cycle (tab10), so that a colour can be lightened.
TAB10 = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def tree_color(label: str) -> str:
    """The same colour for a tree in every plot: stage k is ``Ck`` (tab10), its
    partial commits ``stage k.j`` a lighter ``Ck``, a slowed copy black, the
    peer C9."""
    kind, _, rest = label.partition(" ")
    num, _, suffix = rest.partition(" ")
    if kind != "stage":
        return TAB10[9]
    if suffix:
        return "#000000"
    whole, _, part = num.partition(".")
    if not whole.isdigit():
        return TAB10[9]
    color = TAB10[int(whole) % 9]
    if not part:
        return color
    mix = 0.35 + 0.3 / (int(part) + 1)  # lighter for earlier commits
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _categories(rows: list[dict], *keys: str) -> list[tuple]:
    return list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))


def plot_peak(report: dict, plt):
    """Peak SWA blocks per group against L, one panel per (pattern, W), one line
    per tree, the physical minimum dashed."""
    rows = report["rows"]
    panels = _categories(rows, "pattern", "W")
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    cols = min(2, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(5.5 * cols, 3.8 * nrows), squeeze=False
    )
    for ax, (pattern, W) in zip(axes.flat, panels, strict=False):
        for i, tree in enumerate(trees):
            pts = [
                r
                for r in rows
                if (r["tree"], r["pattern"], r["W"]) == (tree, pattern, W)
            ]
            ax.plot(
                [p["L"] for p in pts],
                [p["swa/group"] for p in pts],
                marker=MARKERS[i % len(MARKERS)],
                markersize=max(3, 8 - i),
                color=tree_color(tree),
                label=tree,
            )
        pts = [
            r
            for r in rows
            if (r["tree"], r["pattern"], r["W"]) == (trees[0], pattern, W)
        ]
        ax.plot(
            [p["L"] for p in pts],
            [min(p["full"], p["swa min"]) for p in pts],
            "k--",
            label="physical minimum",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{pattern}, W={W}")
        ax.set_xlabel("external hit L (tokens)")
        ax.set_ylabel("peak blocks per SWA group")
        ax.grid(True, alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Peak blocks per SWA group right after allocate_slots "
        f"(B={report.get('block_size', 16)})"
    )
    return fig


def plot_admission(report: dict, plt):
    """Longest admitted hit and concurrency at the shared prefix, per (pattern, W):
    HMA off (one group), each tree with HMA on, and the physical limit."""
    rows = report["rows"]
    cats = _categories(rows, "pattern", "W")
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    series = ["HMA off"] + trees
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (
        (
            axes[0],
            "longest hit",
            "HMA off",
            "physical",
            "longest admitted hit (tokens)",
        ),
        (
            axes[1],
            "concurrent@8k",
            "conc. HMA off",
            "conc. physical",
            "requests admitted together",
        ),
    )
    for ax, key, off_key, phys_key, ylabel in panels:
        for j, name in enumerate(series):
            ys = []
            for pattern, W in cats:
                mine = [r for r in rows if (r["pattern"], r["W"]) == (pattern, W)]
                if name == "HMA off":
                    ys.append(mine[0][off_key])
                else:
                    ys.append(next((r[key] for r in mine if r["tree"] == name), 0))
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cats))]
            label = name
            if name == "HMA off":
                label = "HMA off (v0.13.0 + connector)"
            elif name == trees[0]:
                label = f"{name} (HMA on, allocate-then-free)"
            color = "0.6" if name == "HMA off" else tree_color(name)
            ax.bar(xs, ys, width, label=label, color=color)
        for i, (pattern, W) in enumerate(cats):
            phys = next(
                r[phys_key] for r in rows if (r["pattern"], r["W"]) == (pattern, W)
            )
            ax.hlines(
                phys,
                i - 0.45,
                i + 0.45,
                colors="k",
                linestyles="--",
                label="physical limit" if i == 0 else None,
            )
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([f"{p}\nW={w}" for p, w in cats])
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title(
        f"Longest external hit admitted ({report.get('budget_blocks')} blocks)"
    )
    axes[1].set_title("Concurrent requests with an 8k external prefix")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_ratios(report: dict, plt):
    """Ratio tree/base per setting, median with min-max bars, one panel per KV
    cache layout; the 1.01 threshold dashed."""
    rows = [r for r in report.get("rows", []) if r["tree"] != report["rows"][0]["tree"]]
    if not rows:
        return None
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    width = 0.8 / len(trees)
    fig, axes = plt.subplots(
        len(layouts), 1, figsize=(12, 3.6 * len(layouts)), squeeze=False
    )
    for ax, layout in zip(axes.flat, layouts, strict=True):
        mine = [r for r in rows if r["layout"] == layout]
        cats = _categories(mine, "connector", "mode", "requests")
        for j, tree in enumerate(trees):
            pts = [
                next(
                    (
                        r
                        for r in mine
                        if (r["tree"], r["connector"], r["mode"], r["requests"])
                        == (tree, *c)
                    ),
                    None,
                )
                for c in cats
            ]
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cats))]
            med = [p["ratio median"] if p else float("nan") for p in pts]
            lo = [p["ratio median"] - p["ratio min"] if p else 0 for p in pts]
            hi = [p["ratio max"] - p["ratio median"] if p else 0 for p in pts]
            ax.bar(
                xs,
                [m - 1 for m in med],
                width,
                bottom=1,
                yerr=[lo, hi],
                capsize=2,
                label=tree,
                color=tree_color(tree),
            )
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.axhline(bench_cost.THRESHOLD, color="r", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([f"{c}\n{m} {n}" for c, m, n in cats], fontsize=8)
        ax.set_ylabel(f"{report.get('unit', 'cost')} / base")
        ax.set_title(f"layout {layout}")
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=min(len(trees), 5))
    fig.suptitle(f"{report['title']}: ratio to the base, bars min-max over rounds")
    return fig


def plot_eagle(report: dict, plt):
    """Tokens a repeated prompt's hit loses to eagle (hit without eagle - hit
    with eagle) per case, one bar per tree, the rule's loss as a dashed mark
    (one block is the least); one panel per (pattern, W), symlog scale."""
    rows = report["rows"]
    panels = _categories(rows, "pattern", "W")
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    width = 0.8 / len(trees)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False
    )
    for ax, (pattern, W) in zip(axes.flat, panels, strict=True):
        mine = [r for r in rows if (r["pattern"], r["W"]) == (pattern, W)]
        cases = list(dict.fromkeys(r["case"] for r in mine))
        for j, tree in enumerate(trees):
            lost = {
                r["case"]: r["hit without eagle"] - r["hit (eagle)"]
                for r in mine
                if r["tree"] == tree
            }
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cases))]
            ax.bar(
                xs,
                [lost.get(c, 0) for c in cases],
                width,
                label=tree,
                color=tree_color(tree),
            )
        for i, case in enumerate(cases):
            rule = [
                r["hit without eagle"] - r["rule"]
                for r in mine
                if r["case"] == case and r["rule"] != "-"
            ]
            if rule:
                ax.hlines(
                    rule[-1],
                    i - 0.45,
                    i + 0.45,
                    colors="k",
                    linestyles="--",
                    label="rule" if i == 0 else None,
                )
        ax.set_yscale("symlog", linthresh=16)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, fontsize=7)
        ax.set_ylabel("tokens lost to eagle")
        ax.set_title(f"{pattern}, W={W}")
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(
        "Prefix cache hit of a repeated prompt: hit without eagle - hit with eagle"
    )
    return fig


def plot(report_name: str, report: dict, out: Path) -> Path | None:
    """A PNG next to the report when matplotlib is importable (else None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    scenario = next((s for s in SCENARIOS if s.name == report_name), None)
    if scenario is None or scenario.plot is None or not report.get("rows"):
        return None
    fig = scenario.plot(report, plt)
    if fig is None:
        return None
    fig.tight_layout()
    path = out / f"{report_name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _table(headers: list[str], rows: list[list]) -> str:
    return (
        tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True) + "\n"
    )


def summary_markdown(reports: dict[str, dict]) -> str:
    """The results as compact Markdown tables, one column per tree: peak SWA
    blocks per group against the minimum, admission limits against HMA off and
    the physical limit, instruction ratios with their spread, CPU-time ratios."""
    out = []
    peak = reports.get("peak_blocks", {}).get("rows", [])
    if peak:
        trees = list(dict.fromkeys(r["tree"] for r in peak))
        by = {(r["tree"], r["pattern"], r["W"], r["L"]): r for r in peak}
        rows = []
        for pattern, W, L in _categories(peak, "pattern", "W", "L"):
            first = by[(trees[0], pattern, W, L)]
            rows.append(
                [pattern, W, L, first["full"], min(first["full"], first["swa min"])]
                + [
                    by[(t, pattern, W, L)]["swa/group"]
                    if (t, pattern, W, L) in by
                    else "-"
                    for t in trees
                ]
            )
        out.append(
            "### Peak blocks per SWA group (one request, external hit L, B=16)\n"
        )
        out.append(
            _table(["pattern", "W", "L", "full group", "SWA minimum", *trees], rows)
        )
    adm = reports.get("admission", {}).get("rows", [])
    if adm:
        trees = list(dict.fromkeys(r["tree"] for r in adm))
        by = {(r["tree"], r["pattern"], r["W"]): r for r in adm}
        budget = reports["admission"].get("budget_blocks", "?")
        for title, key, off, phys in (
            (
                "Longest admitted external hit (tokens)",
                "longest hit",
                "HMA off",
                "physical",
            ),
            (
                "Requests with an 8k external prefix admitted together",
                "concurrent@8k",
                "conc. HMA off",
                "conc. physical",
            ),
        ):
            rows = []
            for pattern, W in _categories(adm, "pattern", "W"):
                first = by[(trees[0], pattern, W)]
                rows.append(
                    [pattern, W, first[off]]
                    + [
                        by[(t, pattern, W)][key] if (t, pattern, W) in by else "-"
                        for t in trees
                    ]
                    + [first[phys]]
                )
            out.append(f"### {title}, budget {budget} blocks\n")
            out.append(
                _table(
                    [
                        "pattern",
                        "W",
                        "HMA off (v0.13.0 + connector)",
                        f"{trees[0]} (HMA forced on)",
                        *(f"{t} (HMA on)" for t in trees[1:]),
                        "physical limit",
                    ],
                    rows,
                )
            )
    for name, what, fmt in (
        ("scheduler_instructions", "Scheduler instructions per step", "{:,.0f}"),
        ("scheduler_cost", "Scheduler CPU time per step (noisy)", "{:.3f} ms"),
    ):
        report = reports.get(name, {})
        if report.get("rows"):
            out.append(ratio_table(report, what, fmt))
    eagle = reports.get("eagle_hits", {}).get("rows", [])
    if eagle:
        out.append(eagle_markdown(eagle))
    return "\n".join(out)


def ratio_table(report: dict, what: str, fmt: str) -> str:
    """One row per setting: the base's figure and its run-to-run spread, and per
    tree the ratio to the base, median (min-max) over the rounds."""
    rows = report["rows"]
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["tree"], *bench_cost.key(r)): r for r in rows}
    body = []
    for k in _categories(rows, "layout", "connector", "mode", "requests"):
        base = by.get((trees[0], *k))
        cells = []
        for t in trees[1:]:
            r = by.get((t, *k))
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['ratio median']:.3f}"
            if r["reps"] > 1:
                cell += f" ({r['ratio min']:.3f}-{r['ratio max']:.3f})"
            if r["ratio median"] > bench_cost.THRESHOLD:
                cell = f"**{cell}**"
            if not r.get("work = base", True):
                cell += " (other work)"
            cells.append(cell)
        figure = fmt.format(base["median"]) if base else "-"
        spread = f"{base['spread %']:.4f}%" if base and base["runs"] > 1 else "-"
        body.append([*k, figure, spread, *cells])
    reps = max((r["reps"] for r in rows), default=0)
    head = (
        f"### {what}: {trees[0]} and the ratio of each tree to it, median (min-max) "
        f"over {reps} round(s)\n"
    )
    return (
        head
        + "\n"
        + _table(
            ["layout", "connector", "mode", "requests", trees[0], "spread", *trees[1:]],
            body,
        )
    )


SCENARIOS: list[Scenario] = [
    Scenario(
        "peak_blocks",
        lambda ctx: bench_peak(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        plot_peak,
        _memory_failed,
    ),
    Scenario(
        "admission",
        lambda ctx: bench_admission(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        plot_admission,
        _memory_failed,
    ),
    # CPU time before the counts: the fork server of the counts imports vLLM's
    # dependencies under valgrind meanwhile (the timings are noisy anyway).
    Scenario("scheduler_cost", run_cpu_time, plot_ratios),
    Scenario("scheduler_instructions", run_instructions, plot_ratios, _count_failed),
    Scenario(
        "eagle_hits",
        lambda ctx: bench_eagle(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        plot_eagle,
        _memory_failed,
    ),
    # The real engine (build/e2e-env): only with --throughput (minutes of engine
    # processes), in `hmastack run`, not in `make test`.
    Scenario(
        "throughput",
        lambda ctx: bench_throughput.run(ctx.cfg, ctx.quick),
        bench_throughput.plot,
        bench_throughput.failed,
    ),
]
OPTIONAL = ("throughput",)  # run only when asked for (--throughput, --only)


def selected_scenarios(only: str | None, throughput: bool) -> tuple[str, ...]:
    """The names of the scenarios to run: ``only`` (comma-separated) or every
    scenario but the optional ones, plus the throughput when asked for.

    Raises :class:`HmastackError` for an unknown name."""
    names = [s.name for s in SCENARIOS]
    if only:
        chosen = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise HmastackError(
                f"unknown scenario {', '.join(unknown)}", f"one of {', '.join(names)}"
            )
    else:
        chosen = [n for n in names if n not in OPTIONAL]
    if throughput and "throughput" not in chosen:
        chosen.append("throughput")
    return tuple(n for n in names if n in chosen)


def eagle_markdown(rows: list[dict]) -> str:
    """Hit tokens with eagle per case, one column per tree, with the rule's
    value and the hit without eagle (of the last tree) for reference."""
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["tree"], r["pattern"], r["W"], r["case"]): r for r in rows}
    table = []
    for pattern, W, case in _categories(rows, "pattern", "W", "case"):
        mine = [by.get((t, pattern, W, case)) for t in trees]
        # The rule and the hit without eagle: from the latest stage measured.
        ref = max(
            (r for r in mine if r and tree_stage(r["tree"]) is not None),
            key=lambda r: tree_stage(r["tree"]),
        )
        table.append(
            [pattern, W, case, ref["prompt"]]
            + [r["hit (eagle)"] if r else "-" for r in mine]
            + [ref["rule"], ref["hit without eagle"]]
        )
    return "### Prefix cache hits with eagle (tokens, B=16)\n\n" + _table(
        ["pattern", "W", "case", "prompt", *trees, "rule", "without eagle"], table
    )


def cmd_bench(
    quick: bool = False,
    stages: str | None = None,
    no_peer: bool = False,
    instructions: bool = True,
    only: str | None = None,
    throughput: bool = False,
    count_settings: str | None = None,
) -> int:
    """``hmastack bench``: the scenarios ``only`` names (default: all but the
    optional ones; ``throughput`` adds that one)."""
    cfg = config_mod.load()
    failed = run_bench(
        cfg,
        quick,
        stages,
        no_peer,
        instructions,
        selected_scenarios(only, throughput),
        count_settings,
    )
    return 1 if failed else 0


def run_for_pipeline(cfg: Config) -> str:
    """`hmastack run`'s benchmark step: the quick set (memory figures checked
    exactly, the witness of the instruction counts must be caught, ratios
    reported only). Raises :class:`HmastackError` on a failure."""
    chosen = selected_scenarios(None, throughput=True)
    if run_bench(cfg, quick=True, stages_text=None, no_peer=False, only=chosen):
        raise HmastackError(
            "a benchmark check failed (a memory figure, the witness or a "
            "cached-token count of the throughput runs)",
            f"see {cfg.reports / 'bench'} and build/logs/bench/",
        )
    return f"quick set, reports in {cfg.reports / 'bench'}"


def _run_scenarios(
    ctx: Context, out: Path, skipped: dict, failures: list, reports: dict
) -> None:
    for scenario in SCENARIOS:
        if scenario.name not in ctx.selected:
            continue
        t0 = time.monotonic()
        with step(f"bench {scenario.name}"):
            report = scenario.run(ctx)
        # A tree that cannot run a scenario is skipped with its reason; the peer
        # may lack what our env provides.
        for label, why in report.get("errors", {}).items():
            if label == PEER_LABEL:
                skipped[label] = why
            else:
                failures.append(f"{scenario.name}: {label} failed: {why}")
        failures += [f"{scenario.name}: {f}" for f in scenario.failed(report)]
        report["skipped"] = skipped
        report["quick"] = bool(ctx.quick)
        report["seconds"] = round(time.monotonic() - t0)
        report["generated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        (out / f"{scenario.name}.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(scenario.name, report, out)
        print_table(report)
        reports[scenario.name] = report


def run_bench(
    cfg: Config,
    quick: bool,
    stages_text: str | None,
    no_peer: bool,
    instructions: bool = True,
    only: tuple[str, ...] | None = None,
    count_settings: str | None = None,
) -> bool:
    """Run the scenarios ``only`` (default: all but the optional ones) on the
    trees in alternation; True when a check failed. The summary also holds the
    last reports of the scenarios not run."""
    plan = QUICK if quick else FULL
    if count_settings == "quick" and not quick:
        # The full set's trees (every stage, its commits, the peer) on the quick
        # settings: what a loaded machine can count in well under an hour.
        plan = {
            **plan,
            "counts": {
                **plan["counts"],
                "settings": bench_cost.QUICK_SETTINGS,
                "witness_settings": bench_cost.WITNESS_QUICK,
            },
        }
    only = selected_scenarios(None, False) if only is None else only
    instructions = instructions and "scheduler_instructions" in only
    selected = parse_stages(stages_text, cfg, quick)  # validate before any work
    if instructions:
        callgrind.locate()  # fail before any work when valgrind is missing
    pyenv = env_mod.ensure(cfg)
    # The throughput builds its own trees (build/bench/engine, with the compiled
    # kernels); the others run in build/bench/stages and the peer's tree.
    if set(only) <= set(OPTIONAL):
        selected, no_peer = [], True
    trees = (
        [BenchTree("stage 0", stage_tree(cfg, 0))] if selected or not no_peer else []
    )
    trees += [BenchTree(f"stage {k}", stage_tree(cfg, k)) for k in selected]
    skipped = {}
    if not no_peer:
        path, why = peer_tree(cfg)
        if path is not None:
            trees.append(BenchTree(PEER_LABEL, path))
        else:
            skipped[PEER_LABEL] = why
    ctx = Context(cfg, pyenv, trees, plan, quick, selected=only)
    out = cfg.reports / "bench"
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    failures: list[str] = []
    reports = {}
    try:
        if instructions:
            with step("start the instruction counts (marker probe, fork server)"):
                ctx.counting = bench_cost.start_counting(cfg, pyenv, trees[0])
        _run_scenarios(ctx, out, skipped, failures, reports)
    finally:
        if ctx.counting is not None:
            ctx.counting[1].close()
    for s in SCENARIOS:  # the last report of a scenario not run this time
        if s.name not in reports and (out / f"{s.name}.json").is_file():
            with contextlib.suppress(ValueError):
                reports[s.name] = json.loads((out / f"{s.name}.json").read_text())
    (out / SUMMARY).write_text(summary_markdown(reports))
    for label, why in skipped.items():
        console.print(f"[yellow]skipped {label}:[/yellow] {why}")
    for f in failures:
        console.print(f"[red]{f}[/red]")
    total = time.time() - started
    # A run of the optional scenarios alone keeps the last full or quick run's
    # record (the page's "Last run") and writes its own.
    run_file = "run-optional.json" if set(only) <= set(OPTIONAL) else "run.json"
    (out / run_file).write_text(
        json.dumps(
            {
                "quick": bool(quick),
                "seconds": round(total),
                "scenarios": list(only),
                "count_settings": count_settings,
                "trees": [t.label for t in trees],
                "failures": failures,
                "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"bench reports in {out} ({total:.0f}s)")
    return bool(failures)
