"""``hmastack run``: the main job, every step of the pipeline in order.

base → env → apply (all stages into the workspaces) → stage matrix (quick:
the whole suite at the base and the last stage, each other stage's own test
files) → model check → conformance (TLC behaviours replayed, random schedules,
broken copies) → quick benchmarks → end to end (the quick set) → site, then
one summary. ``--full`` (``make run FULL=1``) adds what does not fit in the
main job: the whole suite at every stage, every commit (vLLM's suite and ruff
per commit), the full end-to-end set and the benchmarks' real-engine
throughput.

Each step is the same function its subcommand calls (``run_step`` of its
module). A failing step is reported and the later steps still run where they
can, so one run shows everything that is red; a step that needs an earlier one
green is listed as skipped, with the step that was red.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.table import Table

from hmastack import e2e
from hmastack.bench import run as bench
from hmastack.conform import run as conform
from hmastack.core import config
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console
from hmastack.core.steps import StepResult
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.spec import models as spec
from hmastack.stack import base, env, workspace


@dataclass(frozen=True)
class Step:
    """One step of ``hmastack run``: ``needs`` names the steps that must be
    green first; ``ALL_BEFORE`` stands for every step before this one."""

    name: str
    run: Callable[[Config], StepResult]
    needs: tuple[str, ...] = ()


ALL_BEFORE = "*"


def steps(jobs: int = matrix.DEFAULT_JOBS, full: bool = False) -> list[Step]:
    """The steps of ``hmastack run`` in order (``full``: with every commit, the
    full end-to-end set and the throughput)."""
    chosen = [
        Step("base", lambda cfg: base.run_step(cfg)),
        Step("env", lambda cfg: env.run_step(cfg), ("base",)),
        Step("apply", lambda cfg: workspace.run_step(cfg), ("env",)),
        Step(
            "stage matrix",
            lambda cfg: matrix.run_step(cfg, jobs=jobs, quick=not full),
            ("apply",),
        ),
    ]
    if full:
        chosen.append(
            Step(
                "every commit",
                lambda cfg: matrix.run_step(cfg, per_commit=True, jobs=jobs),
                ("apply",),
            )
        )
    chosen += [
        Step("model check", lambda cfg: spec.run_step(cfg)),
        Step(
            "conformance",
            lambda cfg: conform.run_step(cfg, jobs=jobs),
            (ALL_BEFORE,),
        ),
        Step(
            "benchmarks (quick)",
            lambda cfg: bench.run_step(cfg, quick=True, throughput=full),
            (ALL_BEFORE,),
        ),
        Step(
            "end to end (real engine)",
            lambda cfg: e2e.run_step(cfg, quick=not full, jobs=jobs),
            (ALL_BEFORE,),
        ),
        Step("site", lambda cfg: docs.run_step(cfg)),
    ]
    return chosen


def cmd_run(jobs: int = matrix.DEFAULT_JOBS, full: bool = False) -> int:
    """``hmastack run``: every step in turn, ``jobs`` stages tested at once."""
    cfg = config.load()
    summary: list[tuple[str, str, float]] = []
    green: dict[str, bool] = {}
    # The red steps that a step not green stands for: itself when it ran and
    # failed, the red steps it waited for when it was skipped.
    red_because: dict[str, list[str]] = {}
    for one in steps(jobs, full):
        needed = list(green) if ALL_BEFORE in one.needs else list(one.needs)
        red = list(
            dict.fromkeys(
                cause
                for name in needed
                if not green.get(name, False)
                for cause in red_because.get(name, [name])
            )
        )
        if red:
            green[one.name] = False
            red_because[one.name] = red
            summary.append((one.name, f"skipped: {', '.join(red)} not green", 0.0))
            continue
        start = time.monotonic()
        try:
            result = one.run(cfg)
        except HmastackError as exc:
            result = StepResult(False, f"error: {exc.message.splitlines()[0]}")
            console.print(f"[red]{one.name} failed:[/red] {exc}", markup=True)
        green[one.name] = result.ok
        summary.append((one.name, result.outcome, time.monotonic() - start))

    table = Table(title="hmastack run" + (" --full" if full else ""))
    for column in ("step", "outcome", "seconds"):
        table.add_column(column)
    for name, outcome, seconds in summary:
        table.add_row(name, outcome, f"{seconds:.0f}")
    console.print(table)
    return 0 if all(green.values()) else 1
