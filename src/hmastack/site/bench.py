"""The site's Benchmarks page, from ``build/reports/bench/`` (``hmastack bench``).

Headline figures and plots first, then the tables, where the cost goes (the
profiles of the rows above the threshold), the witness, the method
(``bench/README.md``) and any other report the folder holds (a scenario added
later shows up there without changes here).
"""

from __future__ import annotations

from typing import Any

from hmastack.bench.cost import CostReport, Profile
from hmastack.bench.counts import CountReport
from hmastack.bench.figures import AdmissionReport, LayoutReport, PeakReport
from hmastack.bench.report import BenchRun, ScenarioReport, read_run
from hmastack.bench.throughput import ThroughputReport
from hmastack.bench.throughput_nixl import NixlReport, Prediction
from hmastack.core.config import Config
from hmastack.core.markdown import md_table
from hmastack.site import reports as site_reports

KNOWN = (
    "peak_blocks",
    "admission",
    "scheduler_instructions",
    "scheduler_cost",
    "throughput",
    "throughput_nixl",
    "layout_memory",
)
PLOT_CAPTIONS = {
    "peak_blocks": "Peak blocks per sliding-window group against the external hit "
    "length, each tree, and the physical minimum (dashed).",
    "admission": "Longest admitted external hit and requests with an 8k external "
    "prefix admitted together, under one KV budget, against the physical limit.",
    "scheduler_instructions": "Instructions per scheduler step, ratio of each tree "
    "to the base with min-max bars over rounds; the red line is the 1.01 threshold.",
    "scheduler_cost": "CPU time per scheduler step, ratio to the base (noisy: a "
    "shared machine), min-max bars over rounds.",
    "throughput": "The real engine (vLLM 0.13.0 on CPU) serving a batch of requests "
    "whose long prefixes come from a KV connector: completed requests per second "
    "(median, min-max over rounds), the ratio to the base with the ratio of "
    "admitted requests the block counts predict (dashed), and the most requests "
    "running at once; a memory-bound KV budget and a control budget that holds "
    "the whole batch with HMA off too.",
    "throughput_nixl": "P/D with NixlConnector: the decode engine serving a batch "
    "whose prompts it reads from a prefill engine over NIXL, under the same KV "
    "budgets: completed requests per second, the ratio to the base with the "
    "ratio of admitted requests the block counts predict (dashed), and the most "
    "requests running at once, per layout and budget.",
    "layout_memory": "Peak blocks per KV cache group and admission under one "
    "KV budget for the layouts the stages declare (e.g. full attention + "
    "Mamba), each figure over its physical limit (dashed), per tree.",
    "eagle_hits": "Tokens a repeated prompt's prefix cache hit loses to eagle, per "
    "case and tree, against the rule (dashed).",
}


def _shown(trees: list[str]) -> list[str]:
    """The base, the last stage and the peer (when measured), in that order."""
    stages = [t for t in trees if t.startswith("stage ")]
    others = [t for t in trees if not t.startswith("stage ")]
    return list(dict.fromkeys([trees[0], *stages[-1:], *others[-1:]]))


def headline(reports: dict[str, ScenarioReport], run: BenchRun | None) -> list[str]:
    """One line per result, with its figure: what the series changes."""
    out = []
    peak = reports.get("peak_blocks")
    if isinstance(peak, PeakReport) and peak.rows:
        longest = max(r.L for r in peak.rows)
        mine = [r for r in peak.rows if longest == r.L]
        trees = list(dict.fromkeys(r.tree for r in mine))
        first = mine[0]
        by = {t: [r for r in mine if r.tree == t] for t in trees}
        parts = ", ".join(
            f"{t}: {max(r.swa_per_group for r in by[t])}" for t in _shown(trees)
        )
        out.append(
            f"**Peak blocks**: for an external hit of {longest:,} tokens, a "
            f"sliding-window group holds at most {parts} blocks (the full-attention "
            f"group {first.full:,}; the window minimum is "
            f"{min(r.swa_min for r in mine)}-{max(r.swa_min for r in mine)})."
        )
    adm_report = reports.get("admission")
    if isinstance(adm_report, AdmissionReport) and adm_report.rows:
        adm = adm_report.rows
        trees = list(dict.fromkeys(r.tree for r in adm))
        shown = _shown(trees)
        last = shown[1] if len(shown) > 1 else trees[-1]
        peer = shown[2] if len(shown) > 2 else None
        cells = []
        for r in [x for x in adm if x.tree == last]:
            base = next(
                x for x in adm if (x.tree, x.pattern, x.W) == (trees[0], r.pattern, r.W)
            )
            theirs = next(
                (
                    x.concurrent
                    for x in adm
                    if (x.tree, x.pattern, x.W) == (peer, r.pattern, r.W)
                ),
                None,
            )
            cells.append(
                f"{r.pattern} W={r.W}: {base.concurrent_hma_off} → "
                f"{r.concurrent} (limit {r.concurrent_physical}"
                + (f", {peer} {theirs}" if theirs is not None else "")
                + ")"
            )
        out.append(
            "**Admission** (requests with an 8k external prefix admitted together, "
            f"HMA off on 0.13.0 → {last}): " + "; ".join(cells) + "."
        )
    layouts = reports.get("layout_memory")
    if isinstance(layouts, LayoutReport) and layouts.rows:
        out.append(layouts_headline(layouts))
    counts = reports.get("scheduler_instructions")
    if isinstance(counts, CountReport) and counts.rows:
        rows = counts.rows
        trees = list(dict.fromkeys(r.tree for r in rows))
        spans = []
        for t in trees[1:]:
            ratios = [r.ratio_median for r in rows if r.tree == t]
            spans.append(f"{t} {min(ratios):.3f}-{max(ratios):.3f}")
        spread = [r.spread for r in rows if r.runs > 1]
        above = [r for r in rows if r.ratio_median > counts.threshold]
        settings = {(r.layout, r.connector, r.mode, r.requests) for r in rows}
        line = (
            "**Scheduler instructions per step**, ratio to the base over "
            f"{len(settings)} settings: " + "; ".join(spans) + "."
        )
        if spread:
            line += (
                f" Run-to-run spread of a count: at most {max(spread):.3f}% "
                f"({len(spread)} rows measured more than once)."
            )
        line += f" {len(above)} row(s) above {counts.threshold}" + (
            " (profiles below)." if above else "."
        )
        out.append(line)
        witness = counts.witness
        if witness:
            out.append(
                f"**Witness**: {witness.tree} ({witness.slowdown}) "
                + (
                    "is caught: "
                    + ", ".join(f"{r.ratio_median:.3f}" for r in witness.rows)
                    + f"; the profile names `{(witness.named or ['?'])[0]}`."
                    if witness.caught
                    else f"is **not caught**: {witness.why}."
                )
            )
    cost_report = reports.get("scheduler_cost")
    if isinstance(cost_report, CostReport) and cost_report.rows:
        cost = cost_report.rows
        trees = list(dict.fromkeys(r.tree for r in cost))
        spans = []
        for t in trees[1:]:
            mine_cost = [r for r in cost if r.tree == t]
            spans.append(
                f"{t} {min(r.ratio_min for r in mine_cost):.2f}-"
                f"{max(r.ratio_max for r in mine_cost):.2f}"
            )
        out.append(
            "**Scheduler CPU time** (noisy, beside the counts): ratios to the base "
            "range over " + "; ".join(spans) + "."
        )
    thr = reports.get("throughput")
    if isinstance(thr, ThroughputReport):
        out.append(f"**Throughput**: {thr.headline}")
    else:
        out.append(
            "**Throughput** of the real engine under a KV budget: not measured yet "
            "(it needs the end-to-end harness)."
        )
    pd = reports.get("throughput_nixl")
    if isinstance(pd, NixlReport):
        out.append(
            "**Throughput, P/D with NixlConnector** (decode side): " + pd.headline
        )
    if run:
        out.append(
            f"Last run: {'quick set' if run.quick else 'full set'}"
            + (f" (count settings: {run.count_settings})" if run.count_settings else "")
            + (f", {', '.join(run.scenarios)}" if run.scenarios else "")
            + f", {run.generated}, {run.seconds:.0f} s"
            + _scenario_seconds(reports)
            + (f"; failures: {'; '.join(run.failures)}" if run.failures else "")
            + "."
        )
    return out


def layouts_headline(report: LayoutReport) -> str:
    """Per declared layout, the base's figures against the last stage's, each
    with its physical limit."""
    trees = list(dict.fromkeys(r.tree for r in report.rows))
    shown = _shown(trees)
    last = shown[1] if len(shown) > 1 else trees[-1]
    cells = []
    for layout in dict.fromkeys(r.layout for r in report.rows):
        mine = [r for r in report.rows if r.layout == layout]
        parts = []
        for figure in dict.fromkeys(r.figure for r in mine):
            rows = [r for r in mine if r.figure == figure]
            base = [r.value for r in rows if r.tree == trees[0]]
            ours = [r for r in rows if r.tree == last]
            if not base or not ours:
                continue
            lengths = ", ".join(f"{r.L:,}" for r in ours if r.L)
            parts.append(
                f"{figure}{f' (L {lengths})' if lengths else ''}: "
                f"{', '.join(f'{b:,}' for b in base)} → "
                f"{', '.join(f'{r.value:,}' for r in ours)} (limit "
                f"{', '.join(f'{r.physical:,}' for r in ours)})"
            )
        cells.append(f"{layout}: " + "; ".join(parts))
    return (
        f"**Declared layouts** ({trees[0]} → {last}, budget "
        f"{report.budget_blocks} blocks): " + " | ".join(cells) + "."
    )


def _scenario_seconds(reports: dict[str, ScenarioReport]) -> str:
    """Each scenario's own wall time, as its report records it (``seconds``)."""
    parts = [
        f"{name} {r.seconds:.0f} s"
        for name, r in reports.items()
        if r.seconds is not None
    ]
    return f" (by scenario, from its report: {', '.join(parts)})" if parts else ""


def count_table(report: CountReport) -> str:
    """Instructions per step of every tree and setting, the spread of the counts
    over runs and the ratio to the base (median, min-max over rounds)."""
    body = []
    for r in report.rows:
        ratio = f"{r.ratio_median:.4f}"
        if r.reps > 1:
            ratio += f" ({r.ratio_min:.4f}-{r.ratio_max:.4f})"
        if r.ratio_median > report.threshold:
            ratio = f"**{ratio}**"
        body.append(
            [
                r.tree,
                r.layout,
                r.connector,
                r.mode,
                r.requests,
                f"{r.median:,.0f}",
                f"{r.spread:.4f}%" if r.runs > 1 else "-",
                ratio,
                "" if r.same_work else "other work",
            ]
        )
    return md_table(
        [
            "tree",
            "layout",
            "connector",
            "mode",
            "requests",
            "instructions/step",
            "spread",
            "ratio to base",
            "",
        ],
        body,
    )


def profile_section(profiles: list[Profile], threshold: float) -> list[str]:
    out = []
    if not profiles:
        return [f"No row's ratio is above {threshold}: nothing to explain.\n"]
    for p in profiles:
        out.append(f"### {p.tree}, {p.setting}\n")
        if p.why:
            names = ", ".join(f"`{f}`" for f in p.expected_functions)
            out.append(f"**Expected**: {p.why} Functions behind it: {names}.\n")
        if p.instructions is not None and p.instructions_base:
            out.append(
                f"Instructions {p.instructions_base:,} (base) → "
                f"{p.instructions:,} "
                f"({p.instructions / p.instructions_base:.4f}x).\n"
            )
        if p.python_functions:
            out.append(
                f"Python functions by bytecodes executed ({p.bytecodes_base:,} → "
                f"{p.bytecodes:,}), largest change of their own count first:\n"
            )
            out.append(
                md_table(
                    [
                        "function",
                        "self base",
                        "self",
                        "difference",
                        "share",
                        "inclusive difference",
                        "calls base",
                        "calls",
                    ],
                    [
                        [
                            f"`{f.function}`",
                            f"{f.self_base:,}",
                            f"{f.self_:,}",
                            f"{f.self_difference:+,}",
                            "" if f.share is None else f"{f.share:.0%}",
                            f"{f.inclusive_difference:+,}",
                            f.calls_base,
                            f.calls,
                        ]
                        for f in p.python_functions
                    ],
                )
            )
        if p.c_functions:
            out.append("C functions by callgrind self instructions:\n")
            out.append(
                md_table(
                    ["function", "base", "tree", "difference", "share"],
                    [
                        [
                            f"`{f.function}`",
                            f"{f.base:,}",
                            f"{f.other:,}",
                            f"{f.difference:+,}",
                            "" if f.share is None else f"{f.share:.0%}",
                        ]
                        for f in p.c_functions
                    ],
                )
            )
    return out


def page(cfg: Config, site: Any) -> str:
    """The whole page; plots are added to ``site.assets``."""
    folder = cfg.reports / "bench"
    benches, loose = site_reports.load_benchmarks(cfg)
    out = ["# Benchmarks\n"]
    method = cfg.root / "bench" / "README.md"
    method_text = method.read_text() if method.is_file() else ""
    if method_text.startswith("# "):
        method_text = method_text.split("\n", 1)[1]
    if not benches and not loose:
        out.append(
            '!!! note "Not run yet"\n    The benchmarks write their results and '
            "plots to `build/reports/bench/`; none are there yet.\n"
        )
        out.append("## Method\n")
        out.append(method_text)
        return "\n".join(out)
    reports = {b.name: b.report for b in benches}
    run = read_run(folder)
    out.append("## Headline\n")
    out += [f"* {line}" for line in headline(reports, run)]
    out.append("")
    out.append("## Plots\n")
    plotted = {}
    for b in benches:
        for plot in b.plots:
            site.assets[f"assets/bench/{plot.name}"] = plot.read_bytes()
            plotted[plot.stem] = plot.name
    for name in (*KNOWN, *sorted(set(plotted) - set(KNOWN))):
        if name in plotted:
            caption = PLOT_CAPTIONS.get(name, name.replace("_", " "))
            out.append(f"![{name}](assets/bench/{plotted[name]})\n\n*{caption}*\n")
    for plot in loose:
        site.assets[f"assets/bench/{plot.name}"] = plot.read_bytes()
        out.append(f"![{plot.stem}](assets/bench/{plot.name})\n")
    counts = reports.get("scheduler_instructions")
    if isinstance(counts, CountReport) and counts.rows:
        out.append("## Scheduler instructions per step\n")
        out.append(f"{counts.method}.\n")
        out.append(count_table(counts))
        out.append("## Where the cost goes\n")
        out += profile_section(counts.profiles, counts.threshold)
        witness = counts.witness
        if witness:
            out.append("## Witness: a slowed stage is caught\n")
            out.append(
                f"`{witness.tree}`: {witness.slowdown}; ratios to {witness.of}. "
                + ("Caught" if witness.caught else f"**Not caught**: {witness.why}")
                + ".\n"
            )
            if witness.rows:
                out.append(
                    md_table(
                        ["layout", "connector", "mode", "requests", "ratio"],
                        [
                            [
                                r.layout,
                                r.connector,
                                r.mode,
                                r.requests,
                                f"{r.ratio_median:.4f}",
                            ]
                            for r in witness.rows
                        ],
                    )
                )
            out += profile_section(witness.profiles, counts.threshold)
    thr = reports.get("throughput")
    if isinstance(thr, ThroughputReport) and thr.rows:
        out += throughput_section(thr)
    pd = reports.get("throughput_nixl")
    if isinstance(pd, NixlReport) and pd.rows:
        out += throughput_section(pd, pd.title)
        out += predictions_section(pd.predictions)
    summary = folder / "summary.md"
    if summary.is_file():
        out.append("## Summary of the last run\n")
        out.append(summary.read_text())
    out.append("## Method\n")
    out.append(method_text)
    return "\n".join(out)


def throughput_section(report: ThroughputReport, title: str | None = None) -> list[str]:
    """The real-engine throughput: the verdict per case and tree, then every
    tree's figures."""
    out = [
        f"## {title or 'Real-engine throughput under a KV budget'}\n",
        f"{report.method}.\n",
        "Requests per second here are per CPU second of the engine process "
        "(`time.process_time`: its own work); the wall clock beside them is "
        "inflated by whatever else this shared machine runs. `s median`: CPU "
        "seconds of the measured batch.\n",
    ]
    verdicts = report.verdicts
    if verdicts:
        out.append(
            md_table(
                [
                    "case: tree",
                    "req per CPU s, ratio to base (min-max)",
                    "wall clock ratio (min-max)",
                    "running at once (base → tree)",
                    "predicted admitted ratio",
                    "steps ratio (base / tree)",
                    "≥ predicted",
                ],
                [
                    [
                        name,
                        f"{v.throughput_ratio:.3f} ({v.min:.3f}-{v.max:.3f})",
                        "{:.3f} ({:.3f}-{:.3f})".format(*v.wall_ratio),
                        v.admitted,
                        f"{v.predicted_admitted_ratio:.3f}",
                        f"{v.steps_ratio:.3f}",
                        "yes" if v.at_least_predicted else "no",
                    ]
                    for name, v in verdicts.items()
                ],
            )
        )
    if report.explanation:
        out.append(report.explanation + "\n")
    cols = [
        "case",
        "tree",
        "blocks",
        "req/s median",
        "req/s min",
        "req/s max",
        "s median",
        "wall req/s median",
        "wall s median",
        "steps",
        "max running",
        "predicted running",
        "per-request blocks",
        "peak blocks",
        "peak layer blocks",
        "preemptions",
    ]
    body = [
        [
            _cell(x)
            for x in (
                r.case,
                r.tree,
                r.blocks,
                r.rate_median,
                r.rate_min,
                r.rate_max,
                r.s_median,
                r.wall_rate_median,
                r.wall_s_median,
                r.steps,
                r.max_running,
                r.predicted_running,
                r.per_request_blocks,
                r.peak_blocks,
                r.peak_layer_blocks,
                r.preemptions,
            )
        ]
        for r in report.rows
    ]
    out.append(md_table(cols, body))
    return out


def _cell(value: object) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def predictions_section(predictions: dict[str, Prediction]) -> list[str]:
    """The block counts' prediction beside the measured figures, per case and
    tree."""
    if not predictions:
        return []
    cols = [
        "groups",
        "blocks per request (predicted)",
        "blocks per request (measured)",
        "free blocks",
        "requests at once (predicted)",
        "requests at once (measured)",
        "preemptions",
        "blocks read with NIXL",
        "failed loads",
    ]
    body = [
        [
            name,
            *(
                _cell(x)
                for x in (
                    v.groups,
                    v.blocks_predicted,
                    v.blocks_measured,
                    v.free_blocks,
                    v.at_once_predicted,
                    v.at_once_measured,
                    v.preemptions,
                    v.nixl_blocks_read,
                    v.failed_loads,
                )
            ),
        ]
        for name, v in predictions.items()
    ]
    return [
        "Blocks per request (per KV cache group) and requests at once: "
        "predicted from the layout, measured in the engine.\n",
        md_table(["case: tree", *cols], body),
    ]
