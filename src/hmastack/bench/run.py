"""Benchmarks: what the series changes in memory, admission and scheduler cost.

``hmastack bench [--quick] [--stages KEYS] [--no-peer] [--no-instructions]
[--count-settings quick|full|NAMES] [--no-commits] [--throughput] [--only NAMES]`` runs
the scenarios of :data:`SCENARIOS` (scripts in ``bench/scenarios/``), each INSIDE
one vLLM tree's process (``trees``), on the base, on each
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
   above 1.01 get a profile, as do a stage's above 1.00, which must name the
   Python function behind them (else the command fails); a slowed copy of the
   last stage is the witness that it bites (a missed witness fails the
   command). ``cost``.
4. ``scheduler_cost``: CPU time of the same calls, noisy, beside the counts.
5. ``eagle_hits``: the prefix cache hit (tokens) of a request whose prompt was
   cached (fully, evicted in one group, loaded by a KV connector), with eagle on
   and off. Checked exactly from the stage whose ``[bench] checks`` names
   "eagle-rule" on, against the rule
   (:func:`expected_eagle_hit`); earlier trees and the peer are reported.
6. ``layout_memory``: peak blocks per KV cache group and admission under a
   fixed budget for the KV cache layouts stages declare (``[[bench.layouts]]``
   of ``stage.toml``, e.g. full attention + Mamba), with each figure's ratio
   to the base's; checked exactly against the physical limit from the stage
   that declares a layout on, against a block per token at the base.

Results: ``build/reports/bench/<scenario>.json``, ``summary.md`` (tables), one
``<scenario>.png`` plot each and the tables on the terminal; the site's
Benchmarks page (``hmastack.site.bench``) shows them. Method and limits:
``bench/README.md``. A further scenario plugs in as one more :class:`Scenario`
in :data:`SCENARIOS`.

Optional (``--throughput``, ``--only throughput``; in ``hmastack run --full``, not in
``make test``): ``throughput``, the real engine (``build/e2e-env``) serving a
batch whose long prefixes come from a KV connector under a memory-bound and a
control KV budget, base (HMA off) against the stages whose ``[bench]
throughput`` names the set (``throughput``); and ``throughput_nixl``, the same
budgets on the decode side of a P/D pair with NixlConnector (two engines, NIXL
over UCX on 127.0.0.1), base (HMA off) against the first stage whose ``hma``
names "nixl", on the Gemma-3-like and gpt-oss-like layouts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from hmastack.bench import callgrind
from hmastack.bench import cost as bench_cost
from hmastack.bench import counts as bench_counts
from hmastack.bench import throughput as bench_throughput
from hmastack.bench import throughput_nixl as bench_throughput_nixl
from hmastack.bench.cost import CostReport
from hmastack.bench.counts import CountReport
from hmastack.bench.figures import (
    AdmissionReport,
    Context,
    EagleReport,
    LayoutReport,
    PeakReport,
    Scenario,
    bench_admission,
    bench_eagle,
    bench_layouts,
    bench_peak,
    count_failed,
    memory_failed,
    run_cpu_time,
    run_instructions,
)
from hmastack.bench.plots import (
    plot_admission,
    plot_eagle,
    plot_layouts,
    plot_peak,
    plot_ratios,
    plot_throughput,
)
from hmastack.bench.report import (
    RUN_REPORT,
    BenchRun,
    ScenarioReport,
    read_scenario,
)
from hmastack.bench.tables import print_table, summary_markdown
from hmastack.bench.trees import (
    PEER_LABEL,
    BenchTree,
    bench_tree,
    parse_stages,
    peer_tree,
)
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console, step
from hmastack.core.reports import write as write_report
from hmastack.core.steps import StepResult
from hmastack.stack import env as env_mod

SUMMARY = "summary.md"  # the results as Markdown tables, one column per tree

FULL: dict[str, Any] = {
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
QUICK: dict[str, Any] = {
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


def plot(report_name: str, report: dict, out: Path) -> Path | None:
    """A PNG next to the report, or None for a scenario without a plot or rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


SCENARIOS: list[Scenario] = [
    Scenario(
        "peak_blocks",
        lambda ctx: bench_peak(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        PeakReport,
        plot_peak,
        memory_failed,
    ),
    Scenario(
        "admission",
        lambda ctx: bench_admission(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        AdmissionReport,
        plot_admission,
        memory_failed,
    ),
    # CPU time before the counts: the fork server of the counts imports vLLM's
    # dependencies under valgrind meanwhile (the timings are noisy anyway).
    Scenario("scheduler_cost", run_cpu_time, CostReport, plot_ratios),
    Scenario(
        "scheduler_instructions",
        run_instructions,
        CountReport,
        plot_ratios,
        count_failed,
    ),
    Scenario(
        "eagle_hits",
        lambda ctx: bench_eagle(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        EagleReport,
        plot_eagle,
        memory_failed,
    ),
    Scenario(
        "layout_memory",
        lambda ctx: bench_layouts(ctx.cfg, ctx.pyenv, ctx.trees, ctx.plan),
        LayoutReport,
        plot_layouts,
        memory_failed,
    ),
    # The real engine (build/e2e-env): only with --throughput (minutes of engine
    # processes), in `hmastack run --full`, not in `make test`.
    Scenario(
        "throughput",
        lambda ctx: bench_throughput.run(ctx.cfg, ctx.quick),
        bench_throughput.ThroughputReport,
        plot_throughput,
        bench_throughput.failed,
    ),
    Scenario(
        "throughput_nixl",
        lambda ctx: bench_throughput_nixl.run(ctx.cfg, ctx.quick),
        bench_throughput_nixl.NixlReport,
        plot_throughput,
        bench_throughput_nixl.failed,
    ),
]
# run only when asked for (--throughput runs both, --only names one)
OPTIONAL = ("throughput", "throughput_nixl")


def schema_of(name: str, folder: Path) -> type[ScenarioReport]:
    """The schema of ``<name>.json``: its scenario's; a report no scenario of
    :data:`SCENARIOS` writes is an error."""
    for s in SCENARIOS:
        if s.name == name:
            return s.schema
    raise HmastackError(
        f"{folder / (name + '.json')}: no scenario of hmastack bench writes {name!r} "
        f"(they are {', '.join(s.name for s in SCENARIOS)})",
        "remove the file; `hmastack bench` writes the reports of its scenarios",
    )


def read_report(folder: Path, name: str) -> ScenarioReport | None:
    """``<name>.json`` of ``folder`` as its scenario's schema (None: not
    there); a report that misses a field is an error naming the file and the
    command that writes it anew."""
    return read_scenario(folder / f"{name}.json", schema_of(name, folder))


def encode(scenario: Scenario, report: dict) -> ScenarioReport:
    """A scenario's report as its schema: a field the writer left out (or
    gave the wrong type) is an error naming the scenario."""
    try:
        return msgspec.convert(report, scenario.schema)
    except msgspec.ValidationError as exc:
        raise HmastackError(
            f"the report of {scenario.name} does not match its schema "
            f"{scenario.schema.__name__}: {exc}",
            "the scenario's writer and its schema must agree",
        ) from None


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
    if throughput:
        chosen += [n for n in OPTIONAL if n not in chosen]
    return tuple(n for n in names if n in chosen)


def run_step(
    cfg: Config,
    quick: bool = False,
    stages: str | None = None,
    no_peer: bool = False,
    instructions: bool = True,
    only: str | None = None,
    throughput: bool = False,
    count_settings: str | None = None,
    commits: bool = True,
) -> StepResult:
    """``hmastack bench``: the scenarios ``only`` names (default: all but the
    optional ones; ``throughput`` adds that one); ``commits=False`` leaves out
    the per-commit trees of the full set. Fails when a checked figure (a memory
    figure, the instruction counts' witness, a cached-token count of the
    throughput runs) is off."""
    chosen = selected_scenarios(only, throughput)
    failed, skipped = run_bench(
        cfg,
        quick,
        stages,
        no_peer,
        instructions,
        chosen,
        count_settings,
        commits,
    )
    what = f"{'quick' if quick else 'full'} set: {', '.join(chosen)}"
    # A tree the run left out (the peer release without what a scenario needs)
    # is named in the outcome, so the run's summary shows it.
    what += "".join(f"; skipped {label}: {why}" for label, why in skipped.items())
    if failed:
        return StepResult(
            False, f"{what}: a checked figure is off, see {cfg.reports / 'bench'}"
        )
    return StepResult(True, f"{what}, reports in {cfg.reports / 'bench'}")


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
        write_report(out / f"{scenario.name}.json", encode(scenario, report))
        plot(scenario.name, report, out)
        print_table(report)
        reports[scenario.name] = report


def bench_plan(
    quick: bool, count_settings: str | None = None, commits: bool = True
) -> dict:
    """The plan of a run: :data:`QUICK` or :data:`FULL`; ``count_settings ==
    "quick"`` counts instructions on the quick set's settings (with the full
    set's trees); ``commits=False`` leaves out the trees per commit prefix of a
    stage with several commits (``--no-commits``).

    Raises :class:`HmastackError` for ``quick`` with ``count_settings ==
    "full"``, which the quick set cannot honour."""
    if quick and count_settings == "full":
        raise HmastackError(
            f"--count-settings full counts the full set's "
            f"{len(bench_cost.ALL_SETTINGS)} settings, --quick the quick set's "
            f"{len(bench_cost.QUICK_SETTINGS)}",
            "drop --quick (and add --no-commits to leave out the per-commit trees)",
        )
    plan = QUICK if quick else FULL
    if count_settings not in (None, "quick", "full"):
        if quick:
            raise HmastackError(
                "--count-settings with settings named counts them on the full "
                "set's trees, not with --quick",
                "drop --quick (and add --no-commits to leave out the per-commit trees)",
            )
        chosen = count_settings_named(count_settings)
        # Those settings alone, also the CPU time's; the witness on the quick
        # set's (a setting of few allocations per step would not show it).
        plan = {
            **plan,
            "cost": {**plan["cost"], "settings": chosen},
            "counts": {
                **plan["counts"],
                "settings": chosen,
                "witness_settings": bench_cost.WITNESS_QUICK,
            },
        }
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
    if not commits:
        plan = {**plan, "commits": False}
    return plan


def count_settings_named(text: str) -> list[dict]:
    """The settings of the full set named in ``text``, comma-separated
    (``LAYOUT-CONNECTOR-MODE-REQUESTS``, as the rows name them), in the full
    set's order. Raises :class:`HmastackError` for a name of no setting."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {bench_cost.label(s): s for s in bench_cost.ALL_SETTINGS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise HmastackError(
            "--count-settings: no setting is named "
            + (", ".join(unknown) if unknown else repr(text)),
            "quick, full, or settings of the full set: " + ", ".join(known),
        )
    return [s for label, s in known.items() if label in names]


def run_bench(
    cfg: Config,
    quick: bool,
    stages_text: str | None,
    no_peer: bool,
    instructions: bool = True,
    only: tuple[str, ...] | None = None,
    count_settings: str | None = None,
    commits: bool = True,
) -> tuple[bool, dict[str, str]]:
    """Run the scenarios ``only`` (default: all but the optional ones) on the
    trees in alternation; returns whether a check failed and the trees left out
    with why. The summary also holds the
    last reports of the scenarios not run."""
    plan = bench_plan(quick, count_settings, commits)
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
    trees = [bench_tree(cfg, 0)] if selected or not no_peer else []
    trees += [bench_tree(cfg, k) for k in selected]
    skipped: dict[str, str] = {}
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
    reports: dict[str, dict] = {}
    try:
        if instructions:
            with step("start the instruction counts (marker probe, fork server)"):
                ctx.counting = bench_counts.start_counting(cfg, pyenv, trees[0])
        _run_scenarios(ctx, out, skipped, failures, reports)
    finally:
        if ctx.counting is not None:
            ctx.counting[1].close()
    for s in SCENARIOS:  # the last report of a scenario not run this time
        last = None if s.name in reports else read_report(out, s.name)
        if last is not None:
            reports[s.name] = msgspec.to_builtins(last)
    (out / SUMMARY).write_text(summary_markdown(reports))
    for label, why in skipped.items():
        console.print(f"[yellow]skipped {label}:[/yellow] {why}")
    for f in failures:
        console.print(f"[red]{f}[/red]")
    total = time.time() - started
    # A run of the optional scenarios alone keeps the last full or quick run's
    # record (the page's "Last run"); their own reports give their seconds.
    if set(only) <= set(OPTIONAL):
        console.print(f"bench reports in {out} ({total:.0f}s)")
        return bool(failures), skipped
    run = BenchRun(
        quick=bool(quick),
        seconds=round(total),
        scenarios=list(only),
        count_settings=count_settings,
        trees=[t.label for t in trees],
        failures=failures,
        generated=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    write_report(out / RUN_REPORT, run)
    console.print(f"bench reports in {out} ({total:.0f}s)")
    return bool(failures), skipped
