"""``hmastack run``: the main job, every step of the pipeline in order.

base → env → apply (all stages into the workspaces) → stage matrix → every
commit (vLLM's suite and ruff per commit) → model check → conformance (TLC
behaviours replayed, random schedules, broken copies) → quick benchmarks → end
to end (the real CPU engine at every stage) → site, then one summary. A failing
step is reported and the later steps still run where they can, so one run shows
everything that is red.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.table import Table

from hmastack import e2e
from hmastack.bench import run as bench
from hmastack.conform import run as conform
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console
from hmastack.matrix import reports
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.spec import models as spec
from hmastack.stack import base, env, workspace


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
    ok = do("model check", lambda: spec.run_all_for_pipeline(cfg)) and ok
    if ok:
        ok = do("conformance", lambda: conform.run_for_pipeline(cfg)) and ok
    if ok:
        ok = do("benchmarks (quick)", lambda: bench.run_for_pipeline(cfg)) and ok
    if ok:
        ok = do("end to end (real engine)", lambda: e2e.run_for_pipeline(cfg)) and ok
    ok = do("site", lambda: docs.build_for_pipeline(cfg)) and ok

    table = Table(title="hmastack run")
    for column in ("step", "outcome", "seconds"):
        table.add_column(column)
    for name, outcome, seconds in summary:
        table.add_row(name, outcome, f"{seconds:.0f}")
    console.print(table)
    return 0 if ok else 1
