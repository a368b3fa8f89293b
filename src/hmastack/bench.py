"""Benchmarks: what the series changes in memory, admission and scheduler cost.

``hmastack bench [--quick] [--stages 0,3] [--no-peer]`` runs four scenarios
(``bench/scenarios/*.py``), each INSIDE one vLLM tree's process (the tree on
``PYTHONPATH``, the interpreter of ``build/env``), on the base (stage 0), on each
selected stage and optionally on the vLLM 0.14.0 peer, alternating trees
(A B A B ..., one process per run):

1. ``peak_blocks``: peak blocks per KV cache group for one request with an
   external hit of L tokens, against the physical minimum ceil((W-1)/B)+1 per SWA
   group. Deterministic: checked exactly (a mismatch fails the command).
2. ``admission``: the longest external hit admitted and the number of concurrent
   requests with a long external prefix under a fixed KV budget, with HMA off and
   on, against the physical limit. Deterministic.
3. ``scheduler_cost``: CPU time per schedule()+update_from_output() step with 64
   and 256 requests, decode- and prefill-heavy, without a KV connector and with
   the scripted ``BenchConnector`` (``bench/scenarios/_bench_connector.py``), as
   the ratio stage/base over interleaved repetitions (median, min, max). Never
   fails on timing.
4. ``eagle_hits``: the prefix cache hit (tokens) of a request whose prompt was
   cached (fully, evicted in one group, loaded by a KV connector), with eagle on
   and off. Checked exactly from stage 5 on against the rule
   (:func:`expected_eagle_hit`); earlier trees and the peer are reported.

Results: ``build/reports/bench/<scenario>.json``, ``summary.md`` (the three
results as Markdown tables), one ``<scenario>.png`` plot each
(matplotlib, when importable) and the tables on the terminal. Method and limits:
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hmastack import base as base_mod
from hmastack import config as config_mod
from hmastack import env as env_mod
from hmastack.config import Config, Tree
from hmastack.errors import HmastackError
from hmastack.progress import CommandError, console, run, step

MARKER = "HMASTACK_BENCH_JSON "
PEER_KEY = "vllm-0-14"
SCENARIOS = ("peak_blocks", "admission", "scheduler_cost", "eagle_hits")
SUMMARY = "summary.md"  # the three results as Markdown tables, one column per tree

COST = {
    "sizes": [64, 256],
    "modes": ["decode", "prefill"],
    "connectors": ["none", "connector"],
    "hit_fraction": 0.75,
}
FULL = {
    "lengths": [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
    "windows": [512, 4096],
    "patterns": ["gemma3", "gptoss"],
    "cost": {**COST, "steps": 30},
    "reps": 5,
}
QUICK = {
    "lengths": [1024, 8192, 131072],
    "windows": [512, 4096],
    "patterns": ["gemma3", "gptoss"],
    "cost": {**COST, "steps": 10},
    "reps": 2,
}


@dataclass(frozen=True)
class BenchTree:
    label: str  # "stage 0", "stage 3", "v0.14.0"
    path: Path  # the vLLM source tree


# --- the expected figures ---------------------------------------------------------


def swa_min_blocks(window: int, block_size: int) -> int:
    return math.ceil((window - 1) / block_size) + 1


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
    results, errors = alternate(cfg, pyenv, trees, "eagle_hits", args, 1)
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


# --- trees -----------------------------------------------------------------------


def parse_stages(text: str | None, cfg: Config, quick: bool = False) -> list[int]:
    """The stages to compare with the base: all by default, the last with --quick."""
    if not text:
        return [cfg.num_stages] if quick else list(range(1, cfg.num_stages + 1))
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        for k in range(int(lo), int(hi or lo) + 1):
            if not 0 <= k <= cfg.num_stages:
                raise HmastackError(f"unknown stage {k}", f"0..{cfg.num_stages}")
            out.add(k)
    out.discard(0)
    return sorted(out)


def stage_tree(cfg: Config, k: int) -> Path:
    """The vLLM tree at stage ``k`` under ``build/bench/stages/k/`` (apart from the
    stage matrix's trees, which may be in use), re-applied from ``patches/`` on
    every run so it is never stale."""
    from hmastack import matrix, workspace

    trees = matrix.stage_trees(
        cfg, workspace.discover(cfg), k, root=cfg.build / "bench" / "stages"
    )
    return trees["vllm"]


def peer_tree(cfg: Config) -> tuple[Path | None, str]:
    """The vLLM 0.14.0 source tree under ``build/bench/``, or None and why not."""
    data = tomllib.loads((cfg.root / config_mod.CONFIG_NAME).read_text())
    raw = data.get("peers", {}).get(PEER_KEY)
    if not raw:
        return None, f"no [peers.{PEER_KEY}] in {config_mod.CONFIG_NAME}"
    tree = Tree(
        name=PEER_KEY,
        package=raw["package"],
        version=raw["version"],
        sha256=raw["sha256"].lower(),
        tag=raw.get("tag", f"v{raw['version']}"),
        pip_env={k: str(v) for k, v in raw.get("pip_env", {}).items()},
    )
    dest = cfg.build / "bench" / f"vllm-{tree.version}"
    if not (dest / "vllm" / "__init__.py").is_file():
        try:
            sdist = base_mod.fetch(cfg, tree)
        except HmastackError as exc:
            return None, f"could not fetch {tree.sdist_name}: {exc.message}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (top,) = list(Path(tmp).iterdir())
            shutil.move(str(top), dest)
    return dest, ""


# --- running scenarios -------------------------------------------------------------


def run_scenario(
    cfg: Config, pyenv: env_mod.Env, tree: BenchTree, name: str, args: dict
) -> dict:
    script = cfg.root / "bench" / "scenarios" / f"{name}.py"
    slug = tree.label.replace(" ", "")
    proc = run(
        [pyenv.python, script, json.dumps(args)],
        cwd=tree.path,
        env=pyenv.test_environ([tree.path]),
        log=cfg.build / "logs" / "bench" / f"{name}-{slug}.log",
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CommandError([str(script), tree.label], proc.returncode, tail)
    return json.loads(lines[-1][len(MARKER) :])


def round_order(trees: list, i: int) -> list:
    """The order of round ``i``: forward on even rounds, backward on odd ones
    (A B C, C B A, A B C ...), so that no tree always runs first or last in a
    round (a position effect of the machine then does not bias one ratio)."""
    return list(trees) if i % 2 == 0 else list(reversed(trees))


def alternate(
    cfg: Config,
    pyenv: env_mod.Env,
    trees: list[BenchTree],
    name: str,
    args: dict,
    reps: int,
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Run ``name`` on every tree in turn, ``reps`` rounds; see :func:`round_order`."""
    results: dict[str, list[dict]] = {t.label: [] for t in trees}
    errors: dict[str, str] = {}
    for i in range(reps):
        for t in round_order(trees, i):
            if t.label in errors:
                continue
            try:
                results[t.label].append(run_scenario(cfg, pyenv, t, name, args))
            except CommandError as exc:
                errors[t.label] = exc.message.splitlines()[-1][:300]
    return results, errors


# --- the three scenarios ----------------------------------------------------------


def bench_peak(cfg, pyenv, trees, plan) -> dict:
    args = {k: plan[k] for k in ("lengths", "windows", "patterns")} | {
        "block_size": 16,
        "new_tokens": 1,
    }
    results, errors = alternate(cfg, pyenv, trees, "peak_blocks", args, 1)
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
    results, errors = alternate(cfg, pyenv, trees, "admission", args, 1)
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


def cost_key(row: dict) -> tuple:
    """What identifies one scheduler-cost setting in a run's rows."""
    return (row.get("connector", "none"), row["mode"], row["requests"])


def cost_rows(trees: list[str], results: dict[str, list[dict]]) -> list[dict]:
    """Per tree and setting: the median CPU ms per step and the ratio tree/base
    of each round (run i of a tree against run i of the base, which ran right
    before it), as median, min and max. ``work = base``: whether the tree
    scheduled the same tokens and finished the same requests as the base (else
    the ratio compares different work)."""
    base = trees[0]
    if not results.get(base):
        return []
    rows = []
    for label in trees:
        runs = results.get(label) or []
        if not runs:
            continue
        for r in runs[0]["rows"]:
            key = cost_key(r)
            mine = [x for run in runs for x in run["rows"] if cost_key(x) == key]
            theirs = [
                x for run in results[base] for x in run["rows"] if cost_key(x) == key
            ]
            ms = [x["cpu_ms_per_step"] for x in mine]
            ratios = [
                a["cpu_ms_per_step"] / b["cpu_ms_per_step"]
                for a, b in zip(mine, theirs, strict=False)
                if b["cpu_ms_per_step"] > 0
            ]
            if not ratios:
                continue
            same = all(
                (a.get("scheduled_tokens"), a.get("finished"))
                == (theirs[0].get("scheduled_tokens"), theirs[0].get("finished"))
                for a in mine
            )
            rows.append(
                {
                    "tree": label,
                    "connector": key[0],
                    "mode": key[1],
                    "requests": key[2],
                    "cpu ms/step (median)": round(statistics.median(ms), 3),
                    "cpu ms min-max": f"{min(ms):.3f}-{max(ms):.3f}",
                    "ratio median": round(statistics.median(ratios), 3),
                    "ratio min": round(min(ratios), 3),
                    "ratio max": round(max(ratios), 3),
                    "reps": len(ratios),
                    "work = base": same,
                }
            )
    return rows


def bench_cost(cfg, pyenv, trees, plan) -> dict:
    reps = plan["reps"]
    if plan is QUICK:  # CI time budget: the timing ratio of the peer is not quick
        trees = [t for t in trees if t.label != "v0.14.0"]
    results, errors = alternate(cfg, pyenv, trees, "scheduler_cost", plan["cost"], reps)
    rows = cost_rows([t.label for t in trees], results)
    hma = {
        label: sorted({x["hma"] for run in runs for x in run["rows"] if "hma" in x})
        for label, runs in results.items()
    }
    return {
        "title": "Scheduler CPU cost per step (ratio to base)",
        "method": "time.process_time around schedule()+update_from_output() with "
        "vLLM's create_scheduler (one full-attention group, CPU), without a KV "
        "connector and with the scripted BenchConnector (a synchronous external hit "
        f"of {plan['cost']['hit_fraction']:.0%} of every prompt); trees run "
        f"alternately, {reps} rounds of {plan['cost']['steps']} steps, one process "
        "per run; ratio = tree / base per round; never fails on timing",
        "hma_with_connector": "; ".join(
            f"{label}: {'on' if v == [True] else 'off' if v == [False] else v}"
            for label, v in hma.items()
            if v
        ),
        "errors": errors,
        "rows": rows,
    }


# --- output ------------------------------------------------------------------------


def print_table(report: dict) -> None:
    from rich.table import Table

    rows = report.get("rows", [])
    table = Table(title=report["title"])
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in cols))
    console.print(table)
    for label, why in report.get("errors", {}).items():
        console.print(f"[red]{label} failed:[/red] {why}")


MARKERS = "osD^vP*X"


def tree_color(label: str) -> str:
    """The same colour for a tree in every plot: stage k is ``Ck``, the peer C9."""
    kind, _, num = label.partition(" ")
    return f"C{int(num) % 9}" if kind == "stage" and num.isdigit() else "C9"


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


def plot_cost(report: dict, plt):
    """Ratio tree/base of the scheduler CPU time per step, median with min-max
    bars, one panel per connector setting."""
    rows = [r for r in report["rows"] if r["tree"] != report["rows"][0]["tree"]]
    if not rows:
        return None
    conns = list(dict.fromkeys(r["connector"] for r in rows))
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    width = 0.8 / len(trees)
    fig, axes = plt.subplots(
        1, len(conns), figsize=(6 * len(conns), 4.5), squeeze=False
    )
    for ax, conn in zip(axes.flat, conns, strict=True):
        mine = [r for r in rows if r["connector"] == conn]
        cats = _categories(mine, "mode", "requests")
        for j, tree in enumerate(trees):
            pts = [
                next(
                    (
                        r
                        for r in mine
                        if (r["tree"], r["mode"], r["requests"]) == (tree, *c)
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
                med,
                width,
                yerr=[lo, hi],
                capsize=3,
                label=tree,
                color=tree_color(tree),
            )
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([f"{m}\n{n} req" for m, n in cats])
        ax.set_ylabel("CPU time per step / base")
        ax.set_title("no connector" if conn == "none" else f"with {conn}")
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Scheduler CPU time per step vs base: median, bars min-max over rounds"
    )
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


PLOTS = {
    "peak_blocks": plot_peak,
    "admission": plot_admission,
    "scheduler_cost": plot_cost,
    "eagle_hits": plot_eagle,
}


def plot(report_name: str, report: dict, out: Path) -> Path | None:
    """A PNG next to the report when matplotlib is importable (else None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if report_name not in PLOTS or not report.get("rows"):
        return None
    fig = PLOTS[report_name](report, plt)
    if fig is None:
        return None
    fig.tight_layout()
    path = out / f"{report_name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _md(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def summary_markdown(reports: dict[str, dict]) -> str:
    """The three results as compact Markdown tables, one column per tree:
    peak SWA blocks per group against the minimum, admission limits against
    HMA off and the physical limit, scheduler-cost ratios with their spread."""
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
            _md(["pattern", "W", "L", "full group", "SWA minimum", *trees], rows)
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
                _md(
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
    cost = reports.get("scheduler_cost", {}).get("rows", [])
    if cost:
        trees = list(dict.fromkeys(r["tree"] for r in cost))
        by = {(r["tree"], *cost_key(r)): r for r in cost}
        rows = []
        for key in _categories(cost, "connector", "mode", "requests"):
            base = by.get((trees[0], *key))
            cells = []
            for t in trees[1:]:
                r = by.get((t, *key))
                if r is None:
                    cells.append("-")
                    continue
                spread = f"{r['ratio min']:.2f}-{r['ratio max']:.2f}"
                flag = "" if r.get("work = base", True) else " (other work)"
                cells.append(f"{r['ratio median']:.2f} ({spread}){flag}")
            rows.append([*key, base["cpu ms/step (median)"] if base else "-", *cells])
        reps = max((r["reps"] for r in cost), default=0)
        out.append(
            f"### Scheduler CPU time per step, ratio to {trees[0]}: "
            f"median (min-max) over {reps} rounds\n"
        )
        out.append(
            _md(
                ["connector", "mode", "requests", f"{trees[0]} ms/step", *trees[1:]],
                rows,
            )
        )
    eagle = reports.get("eagle_hits", {}).get("rows", [])
    if eagle:
        out.append(eagle_markdown(eagle))
    return "\n".join(out)


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
    return "### Prefix cache hits with eagle (tokens, B=16)\n\n" + _md(
        ["pattern", "W", "case", "prompt", *trees, "rule", "without eagle"], table
    )


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = config_mod.load()
    failed = run_bench(cfg, args.quick, args.stages, args.no_peer)
    return 1 if failed else 0


def run_for_pipeline(cfg: Config) -> str:
    """`hmastack run`'s benchmark step: the quick set (memory figures checked
    exactly, timings reported only). Raises :class:`HmastackError` on a mismatch."""
    if run_bench(cfg, quick=True, stages_text=None, no_peer=False):
        raise HmastackError(
            "a benchmark figure differs from its expected value",
            f"see {cfg.reports / 'bench'} and build/logs/bench/",
        )
    return f"quick set, reports in {cfg.reports / 'bench'}"


def run_bench(cfg: Config, quick: bool, stages_text: str | None, no_peer: bool) -> bool:
    """Run every scenario on the trees in alternation; True when a check failed."""
    plan = QUICK if quick else FULL
    selected = parse_stages(stages_text, cfg, quick)  # validate before any work
    pyenv = env_mod.ensure(cfg)
    trees = [BenchTree("stage 0", stage_tree(cfg, 0))]
    trees += [BenchTree(f"stage {k}", stage_tree(cfg, k)) for k in selected]
    skipped = {}
    if not no_peer:
        path, why = peer_tree(cfg)
        if path is not None:
            trees.append(BenchTree("v0.14.0", path))
        else:
            skipped["v0.14.0"] = why
    out = cfg.reports / "bench"
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    failed = False
    for name, fn in (
        ("peak_blocks", bench_peak),
        ("admission", bench_admission),
        ("scheduler_cost", bench_cost),
        ("eagle_hits", bench_eagle),
    ):
        with step(f"bench {name} on {', '.join(t.label for t in trees)}"):
            report = fn(cfg, pyenv, trees, plan)
        # A tree that cannot run a scenario is skipped with its reason; the peer
        # may lack what our env provides.
        for label, why in report["errors"].items():
            if label == "v0.14.0":
                skipped[label] = why
        report["skipped"] = skipped
        report["quick"] = bool(quick)
        report["generated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(name, report, out)
        print_table(report)
        failed |= report.get("checked") == "MISMATCH" or any(
            label != "v0.14.0" for label in report["errors"]
        )
    reports = {
        name: json.loads((out / f"{name}.json").read_text()) for name in SCENARIOS
    }
    (out / SUMMARY).write_text(summary_markdown(reports))
    for label, why in skipped.items():
        console.print(f"[yellow]skipped {label}:[/yellow] {why}")
    console.print(f"bench reports in {out} ({time.time() - started:.0f}s)")
    return failed


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="memory, admission and scheduler-cost benchmarks per stage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="the CI set (< 3 min)")
    parser.add_argument(
        "--stages", help="stages to compare with the base, e.g. 3 or 1-3 (default all)"
    )
    parser.add_argument(
        "--no-peer", action="store_true", help="skip the vLLM 0.14.0 peer tree"
    )
    parser.set_defaults(func=cmd_bench)
