"""Run the end-to-end set: stage trees, engine processes, verdicts, report.

For each stage: its trees (``matrix.stage_trees`` under
``build/e2e/stages/<key>``, the compiled kernels placed next to vLLM's sources),
then one engine process per group of scenarios that share engine settings
(``hmastack_testkit.e2e.driver``), and one reference process per model and HMA
setting (no connector, no prefix caching). Each process runs under a watchdog: a
process that outlives its time is killed and its scenarios are reported as
``hang``; an engine that stops making progress is reported by the driver as a
``stall``. The verdicts go to ``build/reports/e2e.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from hmastack.core import reports
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.markdown import md_table
from hmastack.core.progress import console, step
from hmastack.e2e import catalogue as cat
from hmastack.e2e.compare import Verdict, admission_check, judge
from hmastack.e2e.engine import (
    engine_support,
    ensure_models,
    rmtree,
    run_engine_process,
)
from hmastack.e2e.environment import place_kernels

REPORT = "e2e.json"
PROCESS_TIMEOUT = 240.0  # seconds for one engine process, plus per scenario:
SCENARIO_TIMEOUT = 60.0
# The error of a bind to a port another process took (Linux's EADDRINUSE, as
# Python, ZeroMQ and Gloo print it); a NixlConnector pair runs again on new
# ports, up to PORT_ATTEMPTS times.
PORT_TAKEN = "Address already in use"
PORT_ATTEMPTS = 3


@dataclass
class Process:
    """One engine process: a plan for ``hmastack_testkit.e2e.driver``."""

    name: str
    stage: str
    model: str
    hma: bool
    connector: str | None  # None: the reference
    engine: cat.Engine
    functions: list[str]
    pythonhashseed: str = "0"
    namespace: str | None = None
    # P/D consumers run after their producer (wave 1); a NixlConnector pair
    # runs at once (wave 2): the consumer reads the producer's memory
    wave: int = 0
    side_channel_port: int | None = None  # NixlConnector, on 127.0.0.1
    producer: bool = False  # the producer of a P/D pair
    result: dict = field(default_factory=dict)
    seconds: float = 0.0

    def plan(self, model_dir: Path, store: Path) -> dict:
        return {
            "model": self.model,
            "model_dir": str(model_dir),
            "scenarios": self.functions,
            "connector": self.connector,
            "hma": self.hma,
            "store_dir": str(store) if self.connector else None,
            "pool_layer_blocks": self.engine.pool_layer_blocks_hma
            if self.hma and self.engine.pool_layer_blocks_hma is not None
            else self.engine.pool_layer_blocks,
            "max_num_batched_tokens": self.engine.max_num_batched_tokens,
            "max_num_seqs": self.engine.max_num_seqs,
            "async_scheduling": self.engine.async_scheduling,
            "namespace": self.namespace,
            "side_channel_port": self.side_channel_port,
            "kv_events": self.engine.kv_events,
            "extra_config": {
                "num_cpu_blocks": self.engine.num_cpu_blocks,
                "store_delay_steps": self.engine.store_delay_steps,
            }
            if self.connector == "offload"
            else {},
        }


def plan_stage(at: cat.At, scenarios: list[cat.Scenario]) -> list[Process]:
    """The engine processes of one stage for ``scenarios`` (pure)."""
    stage = at.key
    procs: dict[tuple, Process] = {}
    for s in scenarios:
        if not cat.runs_at(s, at):
            continue
        hma = cat.hma_at(s, at)
        conn = cat.connector_at(s, at)
        if s.producer:
            # A NixlConnector producer serves one consumer: one pair each.
            pair = s.name if conn == "nixl" else ""
            namespace = f"pd-{pair}" if pair else "pd"
            phma = hma if s.producer_hma is None else s.producer_hma
            pkey = ("producer", s.producer, s.model, phma, pair)
            procs.setdefault(
                pkey,
                Process(
                    f"{s.producer}-{s.model}-{'hma' if phma else 'nohma'}"
                    + (f"-for-{pair}" if pair else ""),
                    stage,
                    s.model,
                    phma,
                    conn,
                    cat.ENGINES["default"],
                    [s.producer],
                    namespace=namespace,
                    wave=2 if pair else 0,
                    producer=True,
                ),
            )
            key: tuple = ("consumer", s.name, s.model, hma, s.pythonhashseed)
            procs[key] = Process(
                f"{s.name}-{s.model}-seed{s.pythonhashseed}",
                stage,
                s.model,
                hma,
                conn,
                cat.ENGINES["default"],
                [s.name],
                pythonhashseed=s.pythonhashseed,
                namespace=namespace,
                wave=2 if pair else 1,
            )
        else:
            key = ("run", s.model, s.engine, hma, conn, s.name if s.isolated else "")
            suffix = f"-{s.name}" if s.isolated else ""
            proc = procs.setdefault(
                key,
                Process(
                    f"{s.model}-{s.engine}-{'hma' if hma else 'nohma'}-{conn}{suffix}",
                    stage,
                    s.model,
                    hma,
                    conn,
                    cat.ENGINES[s.engine],
                    [],
                ),
            )
            if s.name not in proc.functions:
                proc.functions.append(s.name)
        rkey = ("reference", s.model, hma)
        ref = procs.setdefault(
            rkey,
            Process(
                f"reference-{s.model}-{'hma' if hma else 'nohma'}",
                stage,
                s.model,
                hma,
                None,
                cat.ENGINES["default"],
                [],
            ),
        )
        if s.name not in ref.functions:
            ref.functions.append(s.name)
    return list(procs.values())


def run_process(
    cfg: Config,
    proc: Process,
    trees: dict[str, Path],
    support: list[Path],
    models: Path,
    workdir: Path,
) -> None:
    """Run ``proc`` under a watchdog; fills ``proc.result`` (the driver's JSON,
    or a ``hang`` / ``error`` entry for every scenario)."""
    # One store per process; a P/D pair shares the producer's (a NixlConnector
    # pair's two sides may differ in HMA: Scenario.producer_hma).
    pd = proc.namespace is not None and proc.namespace.startswith("pd")
    pair = f"{proc.namespace}-{proc.model}"
    store = (
        workdir
        / "store"
        / ((pair if proc.wave == 2 else f"{pair}-{proc.hma}") if pd else proc.name)
    )
    timeout = PROCESS_TIMEOUT + SCENARIO_TIMEOUT * len(proc.functions)
    ran = run_engine_process(
        cfg,
        "hmastack_testkit.e2e.driver",
        proc.name,
        proc.plan(models / proc.model, store),
        trees,
        support,
        workdir,
        proc.pythonhashseed,
        timeout,
    )
    proc.seconds = ran.seconds
    hung, log_file = ran.hung, ran.log
    result = ran.result if ran.result is not None else {"scenarios": {}}
    if "error" in result:
        detail = result["error"][-2000:]
        result["scenarios"] = {
            f: {"outcome": "error", "detail": detail} for f in proc.functions
        }
    for f in proc.functions:
        entry = result["scenarios"].setdefault(f, {})
        if not entry or entry.get("outcome") is None:
            entry["outcome"] = "hang" if hung else "error"
            entry["detail"] = (
                f"killed by the watchdog after {timeout:.0f} s (log: {log_file})"
                if hung
                else f"the engine process exited with {ran.returncode} "
                f"(log: {log_file})"
            )
        elif hung and entry.get("outcome") == "ran" and "requests" not in entry:
            entry["outcome"] = "hang"
    proc.result = result


class StageRun(msgspec.Struct):
    """The engine processes of one stage (an entry of the report's ``runs``)."""

    stage: str
    seconds: float
    processes: list[dict]


class E2EReport(msgspec.Struct):
    """build/reports/e2e.json, written by :func:`run_e2e`, read by
    :func:`read_report` (the site's page)."""

    generated: str
    quick: bool  # the CI-sized set
    stages: list[str]  # their keys, in the series' order
    tolerance: float  # of the largest logprob difference
    seconds: float
    runs: list[StageRun]
    verdicts: list[Verdict]


def read_report(path: Path) -> E2EReport | None:
    return reports.read(path, E2EReport, "hmastack e2e")


def run_stage(
    cfg: Config,
    at: cat.At,
    trees: dict[str, Path],
    scenarios: list[cat.Scenario],
    jobs: int,
    models: Path,
) -> tuple[StageRun, list[Verdict]]:
    """Every process of stage ``at``, then the verdicts."""
    start = time.monotonic()
    place_kernels(cfg, trees["vllm"])
    support = engine_support(cfg)
    workdir = cfg.build / "e2e" / "runs" / at.key
    if workdir.exists():
        rmtree(workdir)
    procs = plan_stage(at, scenarios)
    for wave in (0, 1):
        batch = [p for p in procs if p.wave == wave]
        if not batch:
            continue
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [
                pool.submit(run_process, cfg, p, trees, support, models, workdir)
                for p in batch
            ]
            for f in futures:
                f.result()
    # NixlConnector pairs: producer and consumer at once, one pair after another.
    for pair in nixl_pairs(procs):
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for p in pair:
                p.side_channel_port = free_port()
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = [
                    pool.submit(run_process, cfg, p, trees, support, models, workdir)
                    for p in pair
                ]
                for f in futures:
                    f.result()
            taken = port_taken(workdir, pair)
            if taken is None or attempt == PORT_ATTEMPTS:
                break
            print(
                f"  {taken}: a port was taken before it was bound (the side "
                "channel's is chosen before the engine starts); the pair runs "
                "again on a new port",
                flush=True,
            )
    verdicts = judge_stage(at, scenarios, procs)
    run = StageRun(
        at.key,
        round(time.monotonic() - start, 1),
        [
            {
                "name": p.name,
                "scenarios": p.functions,
                "seconds": round(p.seconds, 1),
                "init_seconds": p.result.get("init_seconds"),
                "groups": p.result.get("groups"),
                "pythonhashseed": p.pythonhashseed,
            }
            for p in procs
        ],
    )
    return run, verdicts


def nixl_pairs(procs: list[Process]) -> list[tuple[Process, ...]]:
    """The (producer, consumer) processes of each NixlConnector pair (wave 2)."""
    pairs: dict[tuple, list[Process]] = {}
    for p in procs:
        if p.wave == 2:
            # a pair's two sides may differ in HMA (Scenario.producer_hma)
            pairs.setdefault((p.namespace, p.model), []).append(p)
    return [
        tuple(sorted(pair, key=lambda p: not p.producer)) for pair in pairs.values()
    ]


def port_taken(workdir: Path, procs: tuple[Process, ...]) -> str | None:
    """The name of the first of ``procs`` whose log says that a port it was
    to bind was taken (``free_port`` finds a port that nothing listens on
    *now*; another process may bind it before the engine does)."""
    for p in procs:
        try:
            text = (workdir / f"{p.name}.log").read_text(errors="replace")
        except OSError:
            continue
        if PORT_TAKEN in text:
            return p.name
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def judge_stage(
    at: cat.At, scenarios: list[cat.Scenario], procs: list[Process]
) -> list[Verdict]:
    """The verdicts of one stage from its finished processes (pure)."""

    verdicts = []
    for s in scenarios:
        if not cat.runs_at(s, at):
            continue
        hma = cat.hma_at(s, at)
        conn = cat.connector_at(s, at)
        proc = next((p for p in procs if _runs(p, s, hma, conn)), None)
        ref = next(
            (
                p
                for p in procs
                if p.connector is None and p.model == s.model and p.hma == hma
            ),
            None,
        )
        run_entry = None
        if proc is not None:
            entry = proc.result.get("scenarios", {}).get(s.name)
            if entry is not None:
                run_entry = {**entry, "groups": proc.result.get("groups", [])}
        ref_entry = (ref.result.get("scenarios", {}) if ref else {}).get(s.name)
        if run_entry is not None and "producer freed" in s.checks:
            run_entry = {**run_entry, "producer": _producer_entry(procs, s, hma)}
        verdicts.append(
            judge(
                s,
                at,
                hma,
                conn,
                run_entry,
                ref_entry,
                cat.scenario_id(s),
                s.title,
            )
        )
    _admission(verdicts)
    return verdicts


def _producer_entry(procs: list[Process], s: cat.Scenario, hma: bool) -> dict:
    """The producer's entry of the P/D pair of consumer scenario ``s``."""
    for p in procs:
        if (
            p.producer
            and (p.model, p.hma, p.functions) == (s.model, hma, [s.producer])
            and p.namespace in ("pd", f"pd-{s.name}")
        ):
            return dict(p.result.get("scenarios", {}).get(s.producer, {}))
    return {}


def _runs(p: Process, s: cat.Scenario, hma: bool, conn: str) -> bool:
    """Whether process ``p`` ran scenario ``s`` with the connector (not the
    reference, not a P/D producer)."""
    if p.connector != conn or p.model != s.model or p.hma != hma:
        return False
    if s.producer:
        return (
            p.wave in (1, 2)
            and p.functions == [s.name]
            and p.pythonhashseed == s.pythonhashseed
        )
    return p.wave == 0 and p.engine.name == s.engine and s.name in p.functions


def _admission(verdicts: list[Verdict]) -> None:
    """With HMA on, more long-prefix requests run at once than with HMA off in
    the same memory (both runs at the same stage)."""
    on = next((v for v in verdicts if v.scenario == "admission" and v.hma), None)
    off = next((v for v in verdicts if v.scenario == "admission/hma-off"), None)
    if on is None or off is None:
        return
    ok = admission_check(on, off)
    on.figures["max_running_hma_off"] = off.figures.get("max_running")
    on.checks["admission"] = bool(ok)
    on.passed = on.passed and bool(ok)


def run_e2e(
    cfg: Config,
    stages: list[cat.At],
    quick: bool,
    jobs: int,
    trees_for: Callable[[str], dict[str, Path]],
    only: str | None = None,
    order: list[str] | None = None,
) -> E2EReport:
    """Run the set (``quick``: the CI-sized one; ``only``: the scenarios whose
    id contains it) at ``stages``; returns the report written to
    ``build/reports/e2e.json`` (merged with the last one's other stages, in
    ``order``: the keys of the series)."""
    scenarios = cat.selected(quick, only)
    models = ensure_models(
        cfg, cfg.build / "e2e" / "models", {s.model for s in scenarios}
    )
    start = time.monotonic()
    runs: list[StageRun] = []
    verdicts: list[Verdict] = []
    for at in stages:
        with step(f"stage {at.key}: trees (git am) and compiled kernels"):
            trees = trees_for(at.key)
        n = sum(1 for s in scenarios if cat.runs_at(s, at))
        with step(
            f"stage {at.key}: {n} scenarios in engine processes ({jobs} at once)"
        ):
            run, judged = run_stage(cfg, at, trees, scenarios, jobs, models)
        runs.append(run)
        verdicts += judged
    path = cfg.reports / REPORT
    new = E2EReport(
        generated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        quick=quick,
        stages=[at.key for at in stages],
        tolerance=cat.LOGPROB_TOLERANCE,
        seconds=round(time.monotonic() - start, 1),
        runs=runs,
        verdicts=verdicts,
    )
    try:
        previous = read_report(path)
    except HmastackError:
        previous = None  # another version's report: this run writes it anew
    report = merge_report(previous, new, order or new.stages)
    reports.write(path, report)
    return report


def merge_report(
    previous: E2EReport | None, new: E2EReport, order: list[str]
) -> E2EReport:
    """``new`` plus the stages of ``previous`` it did not run (same set only:
    a quick report never mixes with a full one), in ``order`` (the keys of the
    series; a stage it no longer has is dropped). ``seconds`` stays this
    run's."""
    if previous is None or previous.quick != new.quick:
        return new
    kept = [k for k in previous.stages if k not in new.stages and k in order]
    place = {k: i for i, k in enumerate(order)}
    return msgspec.structs.replace(
        new,
        stages=sorted(kept + new.stages, key=place.__getitem__),
        runs=sorted(
            [r for r in previous.runs if r.stage in kept] + new.runs,
            key=lambda r: place[r.stage],
        ),
        verdicts=sorted(
            [v for v in previous.verdicts if v.stage in kept] + new.verdicts,
            key=lambda v: place[v.stage],
        ),
    )


def failures(report: E2EReport) -> list[str]:
    return [
        f"stage {v.stage} {v.scenario}: {v.outcome}"
        + (f" ({v.detail[:200]})" if v.detail else "")
        for v in report.verdicts
        if not v.passed
    ]


def _cell(v: Verdict) -> str:
    mark = "✓" if v.passed else "✗"
    out = v.outcome
    diff = v.max_logprob_diff
    parts = [f"{mark} {out}"]
    if diff is not None:
        parts.append(diff if isinstance(diff, str) else f"{diff:.1e}")
    hits = [c for c in v.cached if c[1]]
    if hits:
        parts.append(f"{hits[0][2]}/{hits[0][1]}")
    return " · ".join(parts)


def result_table(report: E2EReport) -> str:
    """Scenario x stage, one cell per verdict (markdown)."""
    judged = {v.stage for v in report.verdicts}
    stages = [k for k in dict.fromkeys([*report.stages, *judged]) if k in judged]
    rows: dict[str, dict[str, Verdict]] = {}
    titles: dict[str, str] = {}
    for v in report.verdicts:
        rows.setdefault(v.scenario, {})[v.stage] = v
        titles[v.scenario] = v.title
    table = []
    for name, by_stage in rows.items():
        table.append(
            [f"`{name}`", titles[name]]
            + [_cell(by_stage[k]) if k in by_stage else "-" for k in stages]
        )
    heads = [k if k == "base" else f"stage {k}" for k in stages]
    return md_table(["scenario", "what", *heads], table)


def print_table(report: E2EReport) -> None:
    console.print(result_table(report))
