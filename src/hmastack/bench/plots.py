"""Plots of the benchmark reports (matplotlib, passed in as ``plt``): one figure per
scenario, a colour and a marker per tree.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from hmastack.bench import cost as bench_cost

if TYPE_CHECKING:
    # plt: matplotlib.pyplot, imported by the caller
    from matplotlib.figure import Figure

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
    """The same colour for a tree in every plot: the base ``C0``, stage KEY
    ``Ck`` (tab10, k from the key's digits), its partial commits ``stage
    KEY.J`` a lighter ``Ck``, a slowed copy black, the peer C9."""
    if label == "base":
        return TAB10[0]
    kind, _, rest = label.partition(" ")
    key, _, suffix = rest.partition(" ")
    digits = re.match(r"\d+", key)
    if kind != "stage" or digits is None:
        return TAB10[9]
    if suffix:
        return "#000000"
    color = TAB10[int(digits[0]) % 9]
    _, _, part = key.partition(".")
    if not part:
        return color
    mix = 0.35 + 0.3 / (int(part) + 1)  # lighter for earlier commits
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def categories(rows: list[dict], *keys: str) -> list[tuple]:
    return list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))


def plot_peak(report: dict, plt: Any) -> Figure | None:
    """Peak SWA blocks per group against L, one panel per (pattern, W), one line
    per tree, the physical minimum dashed."""
    rows = report["rows"]
    panels = categories(rows, "pattern", "W")
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
        f"(B={report['block_size']})"
    )
    return fig


def plot_admission(report: dict, plt: Any) -> Figure | None:
    """Longest admitted hit and concurrency at the shared prefix, per (pattern, W):
    HMA off (one group), each tree with HMA on, and the physical limit."""
    rows = report["rows"]
    cats = categories(rows, "pattern", "W")
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
        f"Longest external hit admitted ({report['budget_blocks']} blocks)"
    )
    axes[1].set_title("Concurrent requests with an 8k external prefix")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_ratios(report: dict, plt: Any) -> Figure | None:
    """Ratio tree/base per setting, median with min-max bars, one panel per KV
    cache layout; the 1.01 threshold dashed."""
    rows = [r for r in report["rows"] if r["tree"] != report["rows"][0]["tree"]]
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
        cats = categories(mine, "connector", "mode", "requests")
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
        ax.set_ylabel(f"{report['unit']} / base")
        ax.set_title(f"layout {layout}")
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=min(len(trees), 5))
    fig.suptitle(f"{report['title']}: ratio to the base, bars min-max over rounds")
    return fig


def plot_eagle(report: dict, plt: Any) -> Figure | None:
    """Tokens a repeated prompt's hit loses to eagle (hit without eagle - hit
    with eagle) per case, one bar per tree, the rule's loss as a dashed mark
    (one block is the least); one panel per (pattern, W), symlog scale."""
    rows = report["rows"]
    panels = categories(rows, "pattern", "W")
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


def plot_throughput(report: dict, plt: Any) -> Figure | None:
    """Left: completed requests per CPU second per tree and case (median,
    min-max bars).
    Right: ratio to the base with min-max bars, and the ratio of admitted
    requests the block counts predict (dashed)."""
    rows = report["rows"]
    if not rows:
        return None

    cases = list(dict.fromkeys(r["case"] for r in rows))
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    by = {(r["case"], r["tree"]): r for r in rows}
    width = 0.8 / len(trees)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for j, t in enumerate(trees):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cases))]
        pts = [by.get((c, t)) for c in cases]
        med = [p["req/s median"] if p else 0 for p in pts]
        err = [
            [p["req/s median"] - p["req/s min"] if p else 0 for p in pts],
            [p["req/s max"] - p["req/s median"] if p else 0 for p in pts],
        ]
        a1.bar(xs, med, width, yerr=err, capsize=3, label=t, color=tree_color(t))
        a3.bar(
            xs,
            [max(p["max running"]) if p else 0 for p in pts],
            width,
            label=t,
            color=tree_color(t),
        )
        if j == 0:
            continue
        rat = [p["ratio median"] if p and p["ratio median"] else 0 for p in pts]
        rerr = [
            [
                p["ratio median"] - p["ratio min"] if p and p["ratio min"] else 0
                for p in pts
            ],
            [
                p["ratio max"] - p["ratio median"] if p and p["ratio max"] else 0
                for p in pts
            ],
        ]
        a2.bar(xs, rat, width, yerr=rerr, capsize=3, label=t, color=tree_color(t))
    base = trees[0]
    labelled = False
    for i, c in enumerate(cases):
        b = by.get((c, base))
        for j, t in enumerate(trees):
            r = by.get((c, t))
            if j == 0 or not (b and r):
                continue
            x = i - 0.4 + width * (j + 0.5)
            a2.hlines(
                r["predicted running"] / max(1, b["predicted running"]),
                x - width / 2,
                x + width / 2,
                colors="k",
                linestyles="--",
                label=None if labelled else "admitted ratio predicted by block counts",
            )
            labelled = True
    for ax, title, ylabel in (
        (a1, "Completed requests per CPU second", "requests / CPU s"),
        (a2, "Ratio to the base (min-max over rounds)", "tree / base"),
        (a3, "Most requests running at once", "requests"),
    ):
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(
            [f"{c}\n{report['cases'][c]} layer blocks" for c in cases], fontsize=8
        )
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    a2.axhline(1.0, color="k", linewidth=0.8)
    a1.legend(fontsize=7)
    a2.legend(fontsize=7, loc="center right")
    fig.suptitle(
        f"Real engine, {report['batch']['requests']} requests with "
        f"{report['batch']['prefix']}-token prefixes from a connector"
    )
    return fig


def plot_layouts(report: dict, plt: Any) -> Figure | None:
    """Each declared layout's figures over their physical limit (1 is the
    limit; above it for a peak, below it for admission), one bar per tree,
    one panel per layout, log scale."""
    rows = report["rows"]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    width = 0.8 / len(trees)
    fig, axes = plt.subplots(
        len(layouts), 1, figsize=(11, 3.4 * len(layouts)), squeeze=False
    )
    for ax, layout in zip(axes.flat, layouts, strict=True):
        mine = [r for r in rows if r["layout"] == layout]
        figures = categories(mine, "figure", "L")
        for j, tree in enumerate(trees):
            by = {
                (r["figure"], r["L"]): r["/physical"] for r in mine if r["tree"] == tree
            }
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(figures))]
            ax.bar(
                xs,
                [by.get(f, 0) for f in figures],
                width,
                label=tree,
                color=tree_color(tree),
            )
        ax.axhline(1, color="k", linestyle="--", label="physical limit")
        ax.set_yscale("log", base=2)
        ax.set_xticks(range(len(figures)))
        ax.set_xticklabels([f"{f}\nL={L}" if L else f for f, L in figures], fontsize=7)
        ax.set_ylabel("figure / physical limit")
        ax.set_title(layout)
        ax.legend(fontsize=7)
    return fig
