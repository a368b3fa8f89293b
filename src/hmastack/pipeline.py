"""``hmastack run``: the main job, every step of the pipeline in order.

base → env → apply (all stages into the workspaces) → stage matrix → every
commit (vLLM's suite and ruff per commit) → model check → conformance (TLC
behaviours replayed, random schedules, broken copies) → quick benchmarks → end
to end (the real CPU engine at every stage) → site, then one summary. A failing
step is reported and the later steps still run where they can, so one run shows
everything that is red.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from rich.table import Table

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console
from hmastack.matrix import reports
from hmastack.matrix import stages as matrix
from hmastack.stack import base, env, workspace


def _optional(module: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ModuleNotFoundError, AttributeError):
        return None


def cmd_run(jobs: int = matrix.DEFAULT_JOBS) -> int:
    """``hmastack run``: every step in turn, ``jobs`` stages tested at once."""
    cfg = config.load()
    summary: list[tuple[str, str, float]] = []

    def do(name: str, fn: Callable[[], str]) -> bool:
        start = time.monotonic()
        try:
            outcome = fn()
            ok = True
        except HmastackError as exc:
            outcome, ok = f"error: {exc.message.splitlines()[0]}", False
            console.print(f"[red]{name} failed:[/red] {exc}", markup=True)
        summary.append((name, outcome, time.monotonic() - start))
        return ok

    def do_base() -> str:
        ids = [f"{t.tag} {base.materialize(cfg, t)[:12]}" for t in cfg.trees.values()]
        return ", ".join(ids)

    def do_apply() -> str:
        applied = workspace.apply(cfg, cfg.num_stages)
        return ", ".join(f"{n} {t} patches" for t, n in applied.items())

    def do_matrix() -> str:
        results = matrix.run_matrix(cfg, list(range(cfg.num_stages + 1)), jobs)
        reports.write_stage_report(cfg, results)
        reports.print_stage_table(results)
        red = [str(r.stage) for r in results if not r.ok]
        if red:
            raise HmastackError(f"stages {', '.join(red)} are red")
        return f"stages 0..{cfg.num_stages} green"

    def do_per_commit() -> str:
        commits = matrix.run_per_commit(cfg, jobs)
        reports.write_commit_report(cfg, commits)
        reports.print_commit_table(commits)
        red = [f"{c.tree} {c.index}" for c in commits if not c.ok]
        if red:
            raise HmastackError(f"commits {', '.join(red)} are red")
        return f"{len(commits)} commits green"

    ok = do("base", do_base) and do("env", lambda: str(env.ensure(cfg).root))
    if ok:
        ok = do("apply", do_apply)
        ok = do("stage matrix", do_matrix) and ok
        ok = do("every commit", do_per_commit) and ok
    spec_check = _optional("hmastack.spec.models", "run_all_for_pipeline")
    if spec_check is not None:
        ok = do("model check", lambda: spec_check(cfg)) and ok
    conform_run = _optional("hmastack.conform.run", "run_for_pipeline")
    if conform_run is not None and ok:
        ok = do("conformance", lambda: conform_run(cfg)) and ok
    bench_quick = _optional("hmastack.bench.run", "run_for_pipeline")
    if bench_quick is not None and ok:
        ok = do("benchmarks (quick)", lambda: bench_quick(cfg)) and ok
    e2e_run = _optional("hmastack.e2e", "run_for_pipeline")
    if e2e_run is not None and ok:
        ok = do("end to end (real engine)", lambda: e2e_run(cfg)) and ok
    docs_build = _optional("hmastack.site.docs", "build_for_pipeline")
    if docs_build is not None:
        ok = do("site", lambda: docs_build(cfg)) and ok

    table = Table(title="hmastack run")
    for column in ("step", "outcome", "seconds"):
        table.add_column(column)
    for name, outcome, seconds in summary:
        table.add_row(name, outcome, f"{seconds:.0f}")
    console.print(table)
    return 0 if ok else 1
