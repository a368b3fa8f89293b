"""The site's Benchmarks page, from ``build/reports/bench/`` (``hmastack bench``).

Headline figures and plots first, then the tables, where the cost goes (the
profiles of the rows above the threshold), the witness, the method
(``bench/README.md``) and any other report the folder holds (a scenario added
later shows up there without changes here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hmastack.bench.report import BenchRun, read_run
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
    "eagle_hits": "Tokens a repeated prompt's prefix cache hit loses to eagle, per "
    "case and tree, against the rule (dashed).",
}


def _load(folder: Path, name: str) -> dict:
    try:
        data = json.loads((folder / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shown(trees: list[str]) -> list[str]:
    """The base, the last stage and the peer (when measured), in that order."""
    stages = [t for t in trees if t.startswith("stage ")]
    others = [t for t in trees if not t.startswith("stage ")]
    return list(dict.fromkeys([trees[0], *stages[-1:], *others[-1:]]))


def headline(reports: dict[str, dict], run: BenchRun | None) -> list[str]:
    """One line per result, with its figure: what the series changes."""
    out = []
    peak = reports.get("peak_blocks", {}).get("rows", [])
    if peak:
        longest = max(r["L"] for r in peak)
        mine = [r for r in peak if r["L"] == longest]
        trees = list(dict.fromkeys(r["tree"] for r in mine))
        first = mine[0]
        by = {t: [r for r in mine if r["tree"] == t] for t in trees}
        parts = ", ".join(
            f"{t}: {max(r['swa/group'] for r in by[t])}" for t in _shown(trees)
        )
        out.append(
            f"**Peak blocks**: for an external hit of {longest:,} tokens, a "
            f"sliding-window group holds at most {parts} blocks (the full-attention "
            f"group {first['full']:,}; the window minimum is "
            f"{min(r['swa min'] for r in mine)}-{max(r['swa min'] for r in mine)})."
        )
    adm = reports.get("admission", {}).get("rows", [])
    if adm:
        trees = list(dict.fromkeys(r["tree"] for r in adm))
        shown = _shown(trees)
        last = shown[1] if len(shown) > 1 else trees[-1]
        peer = shown[2] if len(shown) > 2 else None
        cells = []
        for r in [x for x in adm if x["tree"] == last]:
            base = next(
                x
                for x in adm
                if (x["tree"], x["pattern"], x["W"]) == (trees[0], r["pattern"], r["W"])
            )
            theirs = next(
                (
                    x["concurrent@8k"]
                    for x in adm
                    if (x["tree"], x["pattern"], x["W"]) == (peer, r["pattern"], r["W"])
                ),
                None,
            )
            cells.append(
                f"{r['pattern']} W={r['W']}: {base['conc. HMA off']} → "
                f"{r['concurrent@8k']} (limit {r['conc. physical']}"
                + (f", {peer} {theirs}" if theirs is not None else "")
                + ")"
            )
        out.append(
            "**Admission** (requests with an 8k external prefix admitted together, "
            f"HMA off on 0.13.0 → {last}): " + "; ".join(cells) + "."
        )
    counts = reports.get("scheduler_instructions", {})
    if counts.get("rows"):
        rows = counts["rows"]
        trees = list(dict.fromkeys(r["tree"] for r in rows))
        spans = []
        for t in trees[1:]:
            mine = [r["ratio median"] for r in rows if r["tree"] == t]
            spans.append(f"{t} {min(mine):.3f}-{max(mine):.3f}")
        spread = [r["spread %"] for r in rows if r["runs"] > 1]
        above = [r for r in rows if r["ratio median"] > counts.get("threshold", 1.01)]
        line = (
            "**Scheduler instructions per step**, ratio to the base over "
            f"{len({tuple(r[k] for k in ('layout', 'connector', 'mode', 'requests')) for r in rows})}"  # noqa: E501
            " settings: " + "; ".join(spans) + "."
        )
        if spread:
            line += (
                f" Run-to-run spread of a count: at most {max(spread):.3f}% "
                f"({len(spread)} rows measured more than once)."
            )
        line += f" {len(above)} row(s) above {counts.get('threshold', 1.01)}" + (
            " (profiles below)." if above else "."
        )
        out.append(line)
        witness = counts.get("witness")
        if witness:
            out.append(
                f"**Witness**: {witness['tree']} ({witness.get('slowdown', '')}) "
                + (
                    "is caught: "
                    + ", ".join(
                        f"{r['ratio median']:.3f}" for r in witness.get("rows", [])
                    )
                    + f"; the profile names `{(witness.get('named') or ['?'])[0]}`."
                    if witness.get("caught")
                    else f"is **not caught**: {witness.get('why')}."
                )
            )
    cost = reports.get("scheduler_cost", {}).get("rows", [])
    if cost:
        trees = list(dict.fromkeys(r["tree"] for r in cost))
        spans = []
        for t in trees[1:]:
            mine = [r for r in cost if r["tree"] == t]
            spans.append(
                f"{t} {min(r['ratio min'] for r in mine):.2f}-"
                f"{max(r['ratio max'] for r in mine):.2f}"
            )
        out.append(
            "**Scheduler CPU time** (noisy, beside the counts): ratios to the base "
            "range over " + "; ".join(spans) + "."
        )
    if "throughput" in reports:
        out.append(f"**Throughput**: {reports['throughput'].get('headline', '')}")
    else:
        out.append(
            "**Throughput** of the real engine under a KV budget: not measured yet "
            "(it needs the end-to-end harness)."
        )
    if "throughput_nixl" in reports:
        out.append(
            "**Throughput, P/D with NixlConnector** (decode side): "
            + reports["throughput_nixl"].get("headline", "")
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


def _scenario_seconds(reports: dict[str, dict]) -> str:
    """Each scenario's own wall time, as its report records it (``seconds``)."""
    parts = [
        f"{name} {r['seconds']} s"
        for name, r in reports.items()
        if isinstance(r.get("seconds"), int | float)
    ]
    return f" (by scenario, from its report: {', '.join(parts)})" if parts else ""


def count_table(report: dict) -> str:
    """Instructions per step of every tree and setting, the spread of the counts
    over runs and the ratio to the base (median, min-max over rounds)."""
    rows = report["rows"]
    body = []
    for r in rows:
        ratio = f"{r['ratio median']:.4f}"
        if r["reps"] > 1:
            ratio += f" ({r['ratio min']:.4f}-{r['ratio max']:.4f})"
        if r["ratio median"] > report.get("threshold", 1.01):
            ratio = f"**{ratio}**"
        body.append(
            [
                r["tree"],
                r["layout"],
                r["connector"],
                r["mode"],
                r["requests"],
                f"{r['median']:,}",
                f"{r['spread %']:.4f}%" if r["runs"] > 1 else "-",
                ratio,
                "" if r.get("work = base", True) else "other work",
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


def profile_section(profiles: list[dict], threshold: float) -> list[str]:
    out = []
    if not profiles:
        return [f"No row's ratio is above {threshold}: nothing to explain.\n"]
    for p in profiles:
        out.append(f"### {p['tree']}, {p['setting']}\n")
        if "instructions" in p:
            out.append(
                f"Instructions {p['instructions base']:,} (base) → "
                f"{p['instructions']:,} "
                f"({p['instructions'] / p['instructions base']:.4f}x).\n"
            )
        if p.get("python_functions"):
            out.append(
                f"Python functions by bytecodes executed ({p['bytecodes base']:,} → "
                f"{p['bytecodes']:,}), largest change of their own count first:\n"
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
                            f"`{f['function']}`",
                            f"{f['self base']:,}",
                            f"{f['self']:,}",
                            f"{f['self difference']:+,}",
                            "" if f["share"] is None else f"{f['share']:.0%}",
                            f"{f['inclusive difference']:+,}",
                            f["calls base"],
                            f["calls"],
                        ]
                        for f in p["python_functions"]
                    ],
                )
            )
        if p.get("c_functions"):
            out.append("C functions by callgrind self instructions:\n")
            out.append(
                md_table(
                    ["function", "base", "tree", "difference", "share"],
                    [
                        [
                            f"`{f['function']}`",
                            f"{f['base']:,}",
                            f"{f['other']:,}",
                            f"{f['difference']:+,}",
                            "" if f["share"] is None else f"{f['share']:.0%}",
                        ]
                        for f in p["c_functions"]
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
    reports = {b.name: _load(folder, b.name) for b in benches}
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
    counts = reports.get("scheduler_instructions", {})
    if counts.get("rows"):
        out.append("## Scheduler instructions per step\n")
        out.append(f"{counts.get('method', '')}.\n")
        out.append(count_table(counts))
        out.append("## Where the cost goes\n")
        out += profile_section(
            counts.get("profiles", []), counts.get("threshold", 1.01)
        )
        witness = counts.get("witness")
        if witness:
            out.append("## Witness: a slowed stage is caught\n")
            out.append(
                f"`{witness['tree']}`: {witness.get('slowdown', '')}; ratios to "
                f"{witness.get('of', 'the stage it copies')}. "
                + (
                    "Caught"
                    if witness.get("caught")
                    else f"**Not caught**: {witness.get('why')}"
                )
                + ".\n"
            )
            if witness.get("rows"):
                out.append(
                    md_table(
                        ["layout", "connector", "mode", "requests", "ratio"],
                        [
                            [
                                r["layout"],
                                r["connector"],
                                r["mode"],
                                r["requests"],
                                f"{r['ratio median']:.4f}",
                            ]
                            for r in witness["rows"]
                        ],
                    )
                )
            out += profile_section(
                witness.get("profiles", []), counts.get("threshold", 1.01)
            )
    thr = reports.get("throughput", {})
    if thr.get("rows"):
        out += throughput_section(thr)
    pd = reports.get("throughput_nixl", {})
    if pd.get("rows"):
        out += throughput_section(pd, pd.get("title"))
        out += predictions_section(pd.get("predictions", {}))
    summary = folder / "summary.md"
    if summary.is_file():
        out.append("## Summary of the last run\n")
        out.append(summary.read_text())
    out.append("## Method\n")
    out.append(method_text)
    others = [
        b
        for b in benches
        if b.name not in KNOWN and b.name not in ("run", "run-optional", "eagle_hits")
    ]
    if others:
        out.append("## Other reports\n")
    for b in others:
        out.append(f"### {b.title}\n")
        if b.rows:
            cols = list(dict.fromkeys(k for r in b.rows for k in r))[:12]
            out.append(
                md_table(cols, [[str(r.get(c, "")) for c in cols] for r in b.rows])
            )
    return "\n".join(out)


def throughput_section(report: dict, title: str | None = None) -> list[str]:
    """The real-engine throughput: the verdict per case and tree, then every
    tree's figures."""
    out = [
        f"## {title or 'Real-engine throughput under a KV budget'}\n",
        f"{report['method']}.\n",
        "Requests per second here are per CPU second of the engine process "
        "(`time.process_time`: its own work); the wall clock beside them is "
        "inflated by whatever else this shared machine runs. `s median`: CPU "
        "seconds of the measured batch.\n",
    ]
    verdicts = report.get("verdicts", {})
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
                        f"{v['throughput ratio']:.3f} ({v['min']:.3f}-{v['max']:.3f})",
                        "{:.3f} ({:.3f}-{:.3f})".format(*v["wall ratio"]),
                        v["admitted (base → tree)"],
                        f"{v['predicted admitted ratio']:.3f}",
                        f"{v['steps ratio (base / tree)']:.3f}",
                        "yes" if v["at least predicted"] else "no",
                    ]
                    for name, v in verdicts.items()
                ],
            )
        )
    if report.get("explanation"):
        out.append(report["explanation"] + "\n")
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
    out.append(
        md_table(
            cols,
            [
                [
                    ", ".join(map(str, r[c])) if isinstance(r[c], list) else str(r[c])
                    for c in cols
                ]
                for r in report["rows"]
            ],
        )
    )
    return out


def predictions_section(predictions: dict) -> list[str]:
    """The block counts' prediction beside the measured figures, per case and
    tree."""
    if not predictions:
        return []
    cols = list(dict.fromkeys(k for v in predictions.values() for k in v))
    return [
        "Blocks per request (per KV cache group) and requests at once: "
        "predicted from the layout, measured in the engine.\n",
        md_table(
            ["case: tree", *cols],
            [
                [name, *(str(v.get(c, "")) for c in cols)]
                for name, v in predictions.items()
            ],
        ),
    ]
