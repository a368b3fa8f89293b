"""The scheduler cost's instruction counts: one callgrind child per run, forked from a
server that has imported vLLM's dependencies (``bench/scenarios/_forkserver.py``),
several allocator ballasts per setting for the run-to-run spread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from hmastack.bench import callgrind
from hmastack.bench.cost import (
    NAMED,
    SCENARIO,
    THRESHOLD,
    Profile,
    RatioRow,
    Witness,
    WitnessReport,
    check_witness,
    explain,
    key,
    profiles,
    ratio_rows,
    to_profile,
)
from hmastack.bench.report import ScenarioReport
from hmastack.bench.trees import (
    BenchTree,
    parse_output,
    round_order,
    run_scenario,
    scenario_environ,
    scenario_script,
)
from hmastack.core import process
from hmastack.core.config import Config
from hmastack.core.process import CommandError
from hmastack.stack import env as env_mod
from hmastack.stack import series


class CountReport(ScenarioReport, kw_only=True):
    """``scheduler_instructions.json``: instructions per step of every tree
    and setting, the profiles of the rows above the threshold and the
    witness (none when the last stage is the base)."""

    title: str
    method: str
    unit: str
    marker: str
    hardware_counters: str
    steps: int
    threshold: float
    named_above: float
    trees: dict[str, str]  # tree -> what it is (a commit prefix, a slowed copy)
    preload_failed: list[str] | None
    errors: dict[str, str]
    rows: list[RatioRow]
    profiles: list[Profile]
    witness: WitnessReport | None = None


class ForkServer:
    """The parent process of the counted runs (``_forkserver.py`` under
    callgrind). :meth:`run_batch` forks one child per job, ``parallel`` at a
    time; the result rows carry each child's instruction counts."""

    def __init__(
        self,
        cfg: Config,
        pyenv: env_mod.Env,
        cg: callgrind.Callgrind,
        preload: list[str],
        out: Path,
        parallel: int = 2,
    ):
        self.cfg, self.cg, self.out, self.parallel = cfg, cg, out, parallel
        out.mkdir(parents=True, exist_ok=True)
        script = scenario_script(cfg, "_forkserver")
        self.logs = cfg.build / "logs" / "bench"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._log = (self.logs / "forkserver.log").open("w")
        self._jobs = 0
        environ = scenario_environ(cfg, pyenv, [])
        self.proc = process.start(
            [
                *cg.command(out, trace_children=True),
                pyenv.python,
                script,
                json.dumps({"preload": preload}),
            ],
            stdin=subprocess.PIPE,
            env=environ,
            cwd=cfg.root,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self.preload_failed: list[str] | None = None  # known once it is ready

    def _next_report(self) -> tuple[str, dict] | None:
        """The parent's next ``HMASTACK_FORK_DONE`` line (and what it printed
        before it); None when it ended."""
        lines: list[str] = []
        for line in self._stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(_DONE_LINE):
                return "".join(lines), json.loads(line[len(_DONE_LINE) :])
            lines.append(line)
        return None

    def wait_ready(self) -> None:
        """Wait until the parent has imported its preload (it starts at once and
        imports while other scenarios run)."""
        if self.preload_failed is not None:
            return
        ready = self._next_report()
        if ready is None or not ready[1].get("ready"):
            raise CommandError(
                ["_forkserver.py"], self.proc.poll() or 1, ready[0] if ready else ""
            )
        self.preload_failed = ready[1].get("preload_failed", [])

    def run_batch(
        self, jobs: list[tuple[BenchTree, dict]]
    ) -> list[dict | CommandError]:
        """Run every (tree, scenario arguments) job; per job, in order, its
        result (rows with ``instructions``) or the error it ended with."""
        self.wait_ready()
        batch: list[dict] = []
        for tree, args in jobs:
            self._jobs += 1
            output = self.logs / f"count-{self._jobs:03d}-{tree.slug}.log"
            batch.append(
                {
                    "id": len(batch),
                    "tree": str(tree.path),
                    "script": SCENARIO,
                    "args": args,
                    "output": str(output),
                }
            )
            self._log.write(f"### job {self._jobs}: {tree.label} -> {output.name}\n")
        self._stdin.write(json.dumps({"parallel": self.parallel, "jobs": batch}) + "\n")
        self._stdin.flush()
        done: dict[int, dict] = {}
        while True:
            got = self._next_report()
            if got is None:
                raise CommandError(
                    ["_forkserver.py"], self.proc.poll() or 1, "the fork server ended"
                )
            if got[1].get("batch"):
                break
            done[got[1]["id"]] = got[1]
        results: list[dict | CommandError] = []
        for job, (tree, _) in zip(batch, jobs, strict=True):
            try:
                results.append(self._result(tree, job, done.get(job["id"])))
            except CommandError as exc:
                results.append(exc)
        return results

    def _result(self, tree: BenchTree, job: dict, done: dict | None) -> dict:
        output = Path(job["output"]).read_text(errors="replace")
        result = parse_output(output)
        if done is None or done["exit"] != 0 or result is None:
            code = done["exit"] if done else 1
            raise CommandError([SCENARIO, tree.label], code, output)
        dumps = callgrind.dumps_of(self.out, done["pid"], self.cg.marker)
        for r in result["rows"]:
            dump = dumps.get(r["dump"])
            if dump is None or dump.total <= 0:
                raise CommandError(
                    [SCENARIO, tree.label],
                    1,
                    f"no instructions counted for {r['dump']}",
                )
            if dump.marker_calls != r["meter_calls"]:
                raise CommandError(
                    [SCENARIO, tree.label],
                    1,
                    f"{r['dump']}: the marker was entered {dump.marker_calls} "
                    f"times for {r['meter_calls']} measured calls (nested: the "
                    "count would be cut short)",
                )
            r["instructions"] = dump.total
            r["instructions_per_step"] = dump.total / r["steps"]
            r["dump_path"] = str(dump.path)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self._stdin.close()
            process.wait(self.proc, 120)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DONE_LINE = "HMASTACK_FORK_DONE "


def preload_modules(cfg: Config, pyenv: env_mod.Env, tree: BenchTree) -> list[str]:
    """The third-party modules a scenario run imports (a native probe run in
    ``tree``): what the fork server imports once for all children."""
    return run_scenario(cfg, pyenv, tree, SCENARIO, {"list_modules": True})["modules"]


def start_counting(
    cfg: Config, pyenv: env_mod.Env, base: BenchTree
) -> tuple[callgrind.Callgrind, ForkServer]:
    """Pick the marker and start the fork server (its preload runs in the
    background while the other scenarios run natively)."""
    environ = {**os.environ, **scenario_environ(cfg, pyenv, [])}
    cg = callgrind.probe_marker(
        pyenv.python, scenario_script(cfg, SCENARIO).parent, environ
    )
    out = cfg.build / "bench" / "callgrind"
    shutil.rmtree(out, ignore_errors=True)
    return cg, ForkServer(cfg, pyenv, cg, preload_modules(cfg, pyenv, base), out)


# Each round of counts runs with another ballast (see scheduler_cost.ballast):
# the spread of a tree's counts over rounds is their sensitivity to where the
# memory allocator places things, not a timing noise (identical runs repeat).
BALLASTS = (0, 3000, 12000, 40000)


def instruction_counts(
    cfg: Config,
    pyenv: env_mod.Env,
    trees: list[BenchTree],
    plan: dict,
    cg: callgrind.Callgrind,
    server: ForkServer,
    witness: Witness | None = None,
) -> dict:
    """Instructions per step of every setting on every tree in alternation,
    ``plan["reps"]`` rounds, then ``plan["repeat"]`` more rounds of the trees
    named there (the base, the last stage), each round with its own ballast;
    then the profiles of the rows above :data:`THRESHOLD` (a stage's above
    :data:`NAMED`) and the witness."""
    started = time.monotonic()
    args = {
        "meter": "instructions",
        "vgdb": cg.vgdb,
        "entry": cg.entry,
        "steps": plan["steps"],
        "settings": plan["settings"],
    }

    # One batch, run two at a time: round 0 of every tree (alternating order
    # as the other scenarios; counts do not depend on it), the repeats of the
    # trees named in plan["repeat"], then the witness.
    jobs: list[tuple[BenchTree, dict, str]] = []  # (tree, args, whose result)
    for i in range(plan["reps"]):
        for t in round_order(trees, i):
            jobs.append((t, {**args, "ballast": BALLASTS[i % len(BALLASTS)]}, t.label))
    again = [t for t in trees if t.label in plan.get("repeat", ())]
    for i in range(plan["reps"], plan["reps"] + plan.get("repeat_rounds", 0)):
        for t in round_order(again, i):
            jobs.append((t, {**args, "ballast": BALLASTS[i % len(BALLASTS)]}, t.label))
    chosen = plan.get("witness_settings", [])
    # A child's counts depend on the settings it ran before: the stage's first
    # round is the witness's reference when it began with the witness settings
    # (same ballast, same order), else the stage runs them again.
    reuse = witness is not None and plan["settings"][: len(chosen)] == chosen
    if witness is not None:
        wargs = {**args, "settings": chosen, "ballast": BALLASTS[0]}
        if not reuse:
            jobs.append((witness.of, wargs, "witness reference"))
        jobs.append((witness.tree, wargs, witness.tree.label))
    outcomes = server.run_batch([(t, a) for t, a, _ in jobs])
    results: dict[str, list[dict]] = {t.label: [] for t in trees}
    errors: dict[str, str] = {}
    extra: dict[str, dict] = {}
    for (_tree, _, whose), outcome in zip(jobs, outcomes, strict=True):
        if isinstance(outcome, CommandError):
            errors.setdefault(whose, outcome.message.splitlines()[-1][:300])
        elif whose in results:
            results[whose].append(outcome)
        else:
            extra[whose] = outcome
    witness_runs = {}
    if witness is not None and witness.tree.label in extra:
        if reuse and results.get(witness.of.label):
            keys = {key(s) for s in chosen}
            first = results[witness.of.label][0]
            reference: dict | None = {
                **first,
                "rows": [r for r in first["rows"] if key(r) in keys],
            }
        else:
            reference = extra.get("witness reference")
        if reference is not None:
            witness_runs = {
                witness.of.label: [reference],
                witness.tree.label: [extra[witness.tree.label]],
            }
    labels = [t.label for t in trees]
    rows = ratio_rows(labels, results, "instructions_per_step")
    for r in rows:
        for k in ("median", "min", "max"):
            r[k] = int(round(r[k]))
    report = {
        "title": "Scheduler instructions per step (callgrind)",
        "method": "instructions of schedule()+update_from_output() counted by "
        f"callgrind (marker {cg.marker}, instrumentation on only for the measured "
        "steps, one child per run forked from a parent holding vLLM's "
        f"dependencies), trees alternating; {plan['reps']} round(s) of "
        f"{plan['steps']} steps"
        + (
            f", {plan.get('repeat_rounds', 0)} more of {', '.join(plan['repeat'])}"
            if plan.get("repeat_rounds")
            else ""
        )
        + f", each round with its own ballast {BALLASTS}; ratio = tree / base "
        f"per round; a ratio above {THRESHOLD} gets a profile, as does a "
        f"stage's above {NAMED}, which must name a function",
        "unit": "instructions per step",
        "marker": cg.marker,
        "hardware_counters": callgrind.hardware_counters(),
        "steps": plan["steps"],
        "threshold": THRESHOLD,
        "named_above": NAMED,
        "trees": {t.label: t.note for t in trees if t.note},
        "preload_failed": server.preload_failed,
        "errors": errors,
        "rows": rows,
    }
    flagged = [r for r in rows if to_profile(r)]
    report["profiles"] = explain(
        profiles(cfg, pyenv, trees, results, flagged, plan), series.discover(cfg)
    )
    if witness is not None:
        report["witness"] = check_witness(cfg, pyenv, witness, witness_runs, plan)
    report["seconds"] = round(time.monotonic() - started)
    return report
