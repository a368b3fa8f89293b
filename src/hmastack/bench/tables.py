"""The benchmark reports as tables: on the terminal (``print_table``) and as
Markdown (``summary.md``, the ratio and eagle tables).
"""

from __future__ import annotations

from hmastack.bench import cost as bench_cost
from hmastack.bench.plots import (
    categories,
)
from hmastack.bench.trees import is_stage
from hmastack.core.markdown import md_table
from hmastack.core.progress import console


def print_table(report: dict) -> None:
    from rich.table import Table

    rows = report["rows"]
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
    for label, why in report["errors"].items():
        console.print(f"[red]{label} failed:[/red] {why}")
    for p in report.get("profiles", []):
        if p.get("why"):
            console.print(
                f"{p['tree']} {p['setting']}: expected: {p['why']} Functions "
                f"behind it: {', '.join(p['expected functions'])} (shown by the "
                f"profile: {', '.join(bench_cost.shown(p)) or 'none'})."
            )


def summary_markdown(reports: dict[str, dict]) -> str:
    """The results as compact Markdown tables, one column per tree: peak SWA
    blocks per group against the minimum, admission limits against HMA off and
    the physical limit, instruction ratios with their spread, CPU-time ratios."""
    out = []
    peak = reports["peak_blocks"]["rows"] if "peak_blocks" in reports else []
    if peak:
        trees = list(dict.fromkeys(r["tree"] for r in peak))
        by = {(r["tree"], r["pattern"], r["W"], r["L"]): r for r in peak}
        rows = []
        for pattern, W, L in categories(peak, "pattern", "W", "L"):
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
            md_table(["pattern", "W", "L", "full group", "SWA minimum", *trees], rows)
        )
    adm = reports["admission"]["rows"] if "admission" in reports else []
    if adm:
        trees = list(dict.fromkeys(r["tree"] for r in adm))
        adm_by = {(r["tree"], r["pattern"], r["W"]): r for r in adm}
        budget = reports["admission"]["budget_blocks"]
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
            for pattern, W in categories(adm, "pattern", "W"):
                first = adm_by[(trees[0], pattern, W)]
                rows.append(
                    [pattern, W, first[off]]
                    + [
                        adm_by[(t, pattern, W)][key]
                        if (t, pattern, W) in adm_by
                        else "-"
                        for t in trees
                    ]
                    + [first[phys]]
                )
            out.append(f"### {title}, budget {budget} blocks\n")
            out.append(
                md_table(
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
        report = reports.get(name)
        if report and report["rows"]:
            out.append(ratio_table(report, what, fmt))
    eagle = reports["eagle_hits"]["rows"] if "eagle_hits" in reports else []
    if eagle:
        out.append(eagle_markdown(eagle))
    layouts = reports["layout_memory"]["rows"] if "layout_memory" in reports else []
    if layouts:
        out.append(layouts_markdown(layouts, reports["layout_memory"]["budget_blocks"]))
    return "\n".join(out)


def layouts_markdown(rows: list[dict], budget: int) -> str:
    """One table per declared layout: each figure's physical limit and, per
    tree, its value with the ratio to the base's."""
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["tree"], r["layout"], r["figure"], r["L"]): r for r in rows}
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        table = []
        for figure, L in categories(mine, "figure", "L"):
            first = next(r for r in mine if (r["figure"], r["L"]) == (figure, L))
            cells = []
            for t in trees:
                r = by.get((t, layout, figure, L))
                if r is None:
                    cells.append("-")
                elif r["/base"] == "-" or t == trees[0]:
                    cells.append(f"{r['value']:,}")
                else:
                    cells.append(f"{r['value']:,} (x{r['/base']})")
            table.append([figure, L or "-", f"{first['physical']:,}", *cells])
        out.append(
            f"### Layout {layout}: peak blocks per group and admission, budget "
            f"{budget} blocks (x: ratio to {trees[0]})\n"
        )
        out.append(md_table(["figure", "L", "physical limit", *trees], table))
    return "\n".join(out)


def ratio_table(report: dict, what: str, fmt: str) -> str:
    """One row per setting: the base's figure and its run-to-run spread, and per
    tree the ratio to the base, median (min-max) over the rounds."""
    rows = report["rows"]
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["tree"], *bench_cost.key(r)): r for r in rows}
    body = []
    for k in categories(rows, "layout", "connector", "mode", "requests"):
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
            if not r["work = base"]:
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
        + md_table(
            ["layout", "connector", "mode", "requests", trees[0], "spread", *trees[1:]],
            body,
        )
    )


def eagle_markdown(rows: list[dict]) -> str:
    """Hit tokens with eagle per case, one column per tree, with the rule's
    value and the hit without eagle (of the last tree) for reference."""
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["tree"], r["pattern"], r["W"], r["case"]): r for r in rows}
    table = []
    for pattern, W, case in categories(rows, "pattern", "W", "case"):
        mine = [by.get((t, pattern, W, case)) for t in trees]
        # The rule and the hit without eagle: from the latest stage measured
        # (the trees are in the series' order, the peer last).
        ref = [r for r in mine if r and is_stage(r["tree"])][-1]
        table.append(
            [pattern, W, case, ref["prompt"]]
            + [r["hit (eagle)"] if r else "-" for r in mine]
            + [ref["rule"], ref["hit without eagle"]]
        )
    return "### Prefix cache hits with eagle (tokens, B=16)\n\n" + md_table(
        ["pattern", "W", "case", "prompt", *trees, "rule", "without eagle"], table
    )
