"""The benchmark scenarios and their expected figures: what each scenario runs in
the trees (``bench/scenarios/``), the physical limits its deterministic figures
are checked against, and when a report fails the command.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from hmastack.bench import cost as bench_cost
from hmastack.bench import counts as bench_counts
from hmastack.bench.report import ScenarioReport, column
from hmastack.bench.trees import (
    PEER_LABEL,
    BenchTree,
    alternate,
    commit_trees,
    run_scenario,
    slowed_tree,
)
from hmastack.core.config import Config
from hmastack.stack import env as env_mod
from hmastack.stack import series


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
    """One benchmark: ``run`` returns its report (a dict that ``schema``, the
    scenario's :class:`ScenarioReport`, must decode: a writer that leaves out
    a field fails before the report is written); ``plot`` draws it (or None);
    ``failed`` says whether the report fails the command."""

    name: str
    run: Callable[[Context], dict]
    schema: type[ScenarioReport]
    plot: Callable | None = None
    failed: Callable[[dict], list[str]] = lambda report: []


# --- the reports of the deterministic figures (build/reports/bench/) ----------


class CheckedReport(ScenarioReport, kw_only=True):
    """What a scenario with exact figures adds: whether they matched."""

    title: str
    method: str
    checked: str  # "exact" | "MISMATCH"
    mismatches: list[str]
    errors: dict[str, str]


class PeakRow(msgspec.Struct, kw_only=True):
    """One tree, pattern, window and external hit of ``peak_blocks``."""

    tree: str
    pattern: str
    W: int
    L: int
    full: int  # blocks of the full-attention group
    swa_per_group: int = column("swa/group")
    swa_groups: int = column("swa groups")
    swa_min: int = column("swa min")
    swa_over_min: float = column("swa/min")
    pool_blocks: int = column("pool blocks")
    external_arg: bool = column("external arg")


class PeakReport(CheckedReport, kw_only=True):
    """``peak_blocks.json``."""

    rows: list[PeakRow]
    block_size: int


class AdmissionRow(msgspec.Struct, kw_only=True):
    """One tree, pattern and window of ``admission``."""

    tree: str
    pattern: str
    W: int
    longest_hit: int = column("longest hit")
    longest_hit_hma_off: int = column("HMA off")
    longest_hit_physical: int = column("physical")
    concurrent: int = column("concurrent@8k")
    concurrent_hma_off: int = column("conc. HMA off")
    concurrent_physical: int = column("conc. physical")


class AdmissionReport(CheckedReport, kw_only=True):
    """``admission.json``."""

    rows: list[AdmissionRow]
    budget_blocks: int


class LayoutRow(msgspec.Struct, kw_only=True):
    """One tree, layout and figure of ``layout_memory``: the peak blocks of
    one KV cache group for an external hit of L tokens, the longest admitted
    hit (L 0) or the requests with an L-token hit admitted together."""

    tree: str
    layout: str
    figure: str
    L: int
    value: int
    physical: int
    over_physical: float = column("/physical")
    over_base: float | str = column("/base")  # "-": the base has no figure
    # What the figure is checked against: "physical", "every block" (external
    # tokens through num_new_tokens) or "-" (reported).
    checked: str


class LayoutReport(CheckedReport, kw_only=True):
    """``layout_memory.json``."""

    rows: list[LayoutRow]
    budget_blocks: int


class EagleRow(msgspec.Struct, kw_only=True):
    """One tree, pattern, window and case of ``eagle_hits``."""

    tree: str
    pattern: str
    W: int
    case: str
    prompt: int
    hit: int = column("hit (eagle)")
    rule: int | str  # "-": not checked (a connector load before the rule's stage)
    hit_no_eagle: int = column("hit without eagle")


class EagleReport(CheckedReport, kw_only=True):
    """``eagle_hits.json``."""

    rows: list[EagleRow]


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
) -> dict[str, int]:
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


EAGLE_WINDOWS = [128, 512]


def check_from(cfg: Config, check: str) -> int | None:
    """The number of the first stage whose ``[bench] checks`` names ``check``
    (None: no stage does)."""
    stage = series.first_with(series.discover(cfg), check, "bench.checks")
    return None if stage is None else stage.number


def eagle_first_cached_block(kind: str, window: int, B: int, row: dict) -> int:
    """The first block of the first request's prompt that a group holds in the
    prefix cache on a tree with the eagle rule: all of them, except after a
    connector load in a sliding window group, which allocated (and cached)
    only the window of the last block boundary before the first computed
    token, x = min(external, prompt - 1): the end of the hit a later request
    takes in the loaded tokens (SkipStart in spec/EagleHits.tla)."""
    if kind == "full" or not row.get("load"):
        return 0
    x = min(row["external"], row["prompt"] - 1)
    hit_end = (x - 1) // B * B
    return max(0, hit_end - window + 1) // B


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


def bench_eagle(
    cfg: Config, pyenv: env_mod.Env, trees: list[BenchTree], plan: dict
) -> dict:
    B = 16
    args = {"patterns": plan["patterns"], "windows": EAGLE_WINDOWS, "block_size": B}
    results, errors = _run_each(cfg, pyenv, trees, "eagle_hits", args)
    rows, mismatches = [], []
    # The first stage whose hits follow the rule: its hits and those of the
    # stages after it are checked exactly, earlier trees and the peer reported.
    rule_from = check_from(cfg, "eagle-rule")
    stage_of = {t.label: t.stage for t in trees}
    # No stage's hit (a commit's included) is below the base's, in any case.
    base = {
        (r["pattern"], r["window"], r["case"]): r["hit"]
        for t in trees[:1]
        if t.stage == 0
        for runs in [results.get(t.label) or []]
        for r in (runs[0]["rows"] if runs else [])
    }
    for label, runs in results.items():
        stage = stage_of.get(label)
        checked = stage is not None and rule_from is not None and stage >= rule_from
        for r in runs[0]["rows"] if runs else []:
            kinds = GROUP_KINDS[r["pattern"]]
            rule = expected_eagle_hit(kinds, r["window"], B, r)
            where = f"{label}: {r['pattern']} W={r['window']} {r['case']}"
            if checked and r["hit"] != rule:
                mismatches.append(f"{where}: hit {r['hit']} (want {rule})")
            floor = base.get((r["pattern"], r["window"], r["case"]))
            if stage and floor is not None and r["hit"] < floor:
                mismatches.append(f"{where}: hit {r['hit']} (the base's {floor})")
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
        "longest hit by the rule, checked exactly "
        + (
            f"from stage {series.key_of(series.discover(cfg), rule_from)} on; "
            if rule_from
            else "nowhere (no stage names the rule); "
        )
        + "at every stage (and commit) no hit below the base's",
        "checked": "exact" if not mismatches else "MISMATCH",
        "mismatches": mismatches,
        "errors": errors,
        "rows": rows,
    }


def bench_peak(
    cfg: Config, pyenv: env_mod.Env, trees: list[BenchTree], plan: dict
) -> dict:
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


def layout_group_blocks(kind: str, L: int, n: int, B: int, physical: bool) -> int:
    """Blocks a group of ``kind`` holds after admitting a request of L + n
    tokens whose first L (a multiple of B) a connector loads. Full attention:
    a block per token. Mamba at the physical limit: the block of the state
    after token L - 1 and the blocks of the tokens it computes; else (external
    tokens through ``num_new_tokens``, as 0.13.0 takes them) a block per
    token."""
    total = math.ceil((L + n) / B)
    if kind == "mamba" and physical and L > 0:
        return total - (L - 1) // B
    return total


def layout_request_blocks(
    kinds: Sequence[str], L: int, n: int, B: int, physical: bool
) -> int:
    return sum(layout_group_blocks(k, L, n, B, physical) for k in kinds)


def layout_admission(
    kinds: Sequence[str], B: int, n: int, N: int, prefix: int, physical: bool
) -> tuple[int, int]:
    """The longest admitted hit (a multiple of B) and the requests with a
    ``prefix``-token hit admitted together under N blocks (one null block)."""
    usable = N - 1
    lo, hi = 0, N
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if layout_request_blocks(kinds, mid * B, n, B, physical) <= usable:
            lo = mid
        else:
            hi = mid
    return lo * B, usable // layout_request_blocks(kinds, prefix, n, B, physical)


def declared_layouts(cfg: Config) -> list[tuple[int, series.BenchLayout]]:
    """Each ``[[bench.layouts]]`` of the series with the number of the stage
    that declares it."""
    return [
        (stage.number, layout)
        for stage in series.discover(cfg)
        for layout in stage.info.bench.layouts
    ]


def check_layouts(
    report: dict, layouts: list[tuple[int, series.BenchLayout]], stage: int | None
) -> tuple[list[dict], list[str]]:
    """A tree's ``layout_memory`` figures with what each is checked against:
    the physical limit from the stage that declares the layout on, a block
    per token at the base; other trees (earlier stages, the peer) are
    reported. Returns the rows (without the ratio to the base) and the
    mismatches."""
    B, n = report["block_size"], report["new_tokens"]
    N, prefix = report["num_blocks"], report["shared_prefix"]
    declared = {layout.name: (number, layout) for number, layout in layouts}
    rows, bad = [], []
    for r in report["rows"]:
        number, layout = declared[r["layout"]]
        kinds = list(layout.groups)
        if stage is not None and stage >= number:
            checked = "physical"
        elif stage == 0:
            checked = "every block"
        else:
            checked = "-"
        want = None
        if r["figure"] == "peak":
            L = r["external"]
            if r["loaded"] != L:
                bad.append(f"{r['layout']} L={L}: loads {r['loaded']} tokens")
            figures = [
                (
                    f"peak, group {i} ({kind})",
                    value,
                    layout_group_blocks(kind, L, n, B, True),
                    layout_group_blocks(kind, L, n, B, checked == "physical"),
                )
                for i, (kind, value) in enumerate(zip(kinds, r["blocks"], strict=True))
            ]
        else:
            L = r.get("external", 0)
            index = 0 if r["figure"] == "longest_hit" else 1
            title = "longest hit" if index == 0 else "requests admitted together"
            phys = layout_admission(kinds, B, n, N, prefix, True)[index]
            want = layout_admission(kinds, B, n, N, prefix, checked == "physical")
            figures = [(title, r["value"], phys, want[index])]
        for figure, value, physical, expected in figures:
            if checked != "-" and value != expected:
                at = f" L={L}" if L else ""
                bad.append(
                    f"{r['layout']} {figure}{at}: {value} (want {expected}, {checked})"
                )
            rows.append(
                {
                    "layout": r["layout"],
                    "figure": figure,
                    "L": L,
                    "value": value,
                    "physical": physical,
                    "/physical": round(value / physical, 2) if physical else 0.0,
                    "/base": "-",
                    "checked": checked,
                }
            )
    return rows, bad


def bench_layouts(
    cfg: Config, pyenv: env_mod.Env, trees: list[BenchTree], plan: dict
) -> dict:
    layouts = declared_layouts(cfg)
    N, prefix = 4096, 8192
    args = {
        "layouts": [
            {"name": lay.name, "groups": list(lay.groups), "lengths": lay.lengths}
            for _, lay in layouts
        ],
        "block_size": 16,
        "new_tokens": 1,
        "num_blocks": N,
        "shared_prefix": prefix,
    }
    results, errors = _run_each(cfg, pyenv, trees, "layout_memory", args)
    stage_of = {t.label: t.stage for t in trees}
    rows, mismatches = [], []
    base: dict[tuple, int] = {}
    for label, runs in results.items():
        if not runs:
            continue
        mine, bad = check_layouts(runs[0], layouts, stage_of.get(label))
        mismatches += [f"{label}: {m}" for m in bad]
        for r in mine:
            key = (r["layout"], r["figure"], r["L"])
            if stage_of.get(label) == 0:
                base[key] = r["value"]
            rows.append({"tree": label, **r})
    for r in rows:
        b = base.get((r["layout"], r["figure"], r["L"]))
        r["/base"] = round(r["value"] / b, 3) if b else "-"
    declared = ", ".join(
        f"{lay.name} ({' + '.join(lay.groups)}) from stage "
        f"{series.key_of(series.discover(cfg), number)}"
        for number, lay in layouts
    )
    return {
        "title": "Peak blocks and admission of the declared layouts",
        "method": "one single-layer KV cache group per kind; one new request of "
        "L+1 tokens, L external (asked of get_num_external_computed_tokens where "
        "the tree has it), blocks held right after allocate_slots; the longest "
        f"admitted hit (multiples of B) and requests with an {prefix}-token "
        f"external hit admitted together under {N} blocks; B=16; checked "
        "exactly against the physical limit from the stage that declares the "
        "layout on, against a block per token at the base: "
        + (declared or "no stage declares a layout"),
        "budget_blocks": N,
        "checked": "exact" if not mismatches else "MISMATCH",
        "mismatches": mismatches,
        "errors": errors,
        "rows": rows,
    }


def bench_admission(
    cfg: Config, pyenv: env_mod.Env, trees: list[BenchTree], plan: dict
) -> dict:
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
    stages = [t for t in ctx.trees if t.stage is not None]
    out = [stages[0]]
    commits: dict[int, list[BenchTree]] = {}
    if ctx.plan["commits"]:
        numbers = [t.stage for t in stages[1:] if t.stage is not None]
        for t in commit_trees(ctx.cfg, numbers):
            commits.setdefault(t.stage or 0, []).append(t)
    for t in stages[1:]:
        out += commits.get(t.stage or 0, [])
        out.append(t)
    if ctx.plan["peer_cost"]:
        out += [t for t in ctx.trees if t.label == PEER_LABEL]
    return out


def run_instructions(ctx: Context) -> dict:
    if ctx.counting is None:
        return {
            "title": "Scheduler instructions per step",
            "method": "not counted (--no-instructions)",
            "unit": "instructions per step",
            "marker": "",
            "hardware_counters": "",
            "steps": 0,
            "threshold": bench_cost.THRESHOLD,
            "named_above": bench_cost.NAMED,
            "trees": {},
            "preload_failed": None,
            "errors": {},
            "rows": [],
            "profiles": [],
        }
    cg, server = ctx.counting
    trees = count_trees(ctx)
    stages = [t for t in ctx.trees if t.stage is not None]
    last = stages[-1]
    plan = {**ctx.plan["counts"]}
    plan["repeat"] = [stages[0].label, last.label][: plan.get("repeat_trees", 2)]
    witness = None
    if last is not stages[0] and last.stage:
        slowed = slowed_tree(ctx.cfg, last.stage, bench_cost.SLOWDOWN)
        witness = bench_cost.Witness(slowed, last)
    return bench_counts.instruction_counts(
        ctx.cfg, ctx.pyenv, trees, plan, cg, server, witness
    )


def memory_failed(report: dict) -> list[str]:
    return list(report.get("mismatches", []))


def count_failed(report: dict) -> list[str]:
    failed = bench_cost.unnamed_rows(report) + bench_cost.unexplained_profiles(report)
    w = report.get("witness")
    if w is not None and not w.get("caught"):
        failed.append(f"the witness {w['tree']} was not caught: {w.get('why')}")
    return failed
