"""The scheduler's cost per step: instructions (the figure), CPU time (noisy),
and where a difference goes.

Both measures run ``bench/scenarios/scheduler_cost.py`` (settings: KV cache
layout x connector x mode x requests) on the base, the stages and the peer;
only ``schedule()`` and ``update_from_output()`` are measured:

* :func:`~hmastack.bench.counts.instruction_counts`: instructions counted by callgrind
  (:mod:`hmastack.bench.callgrind`), one child per run forked from a parent that has
  imported vLLM's dependencies (``bench/scenarios/_forkserver.py``). Deterministic
  up to the memory allocator's state: the run-to-run spread of each count is
  reported and is far below the 1% that a ratio must exceed to count as a cost.
* :func:`cpu_time`: ``time.process_time`` over the same calls, one native
  process per run; noisy on a shared machine, reported beside the counts.
* :func:`profiles`: for every row whose instruction ratio to the base exceeds
  :data:`THRESHOLD`, the C functions (callgrind self counts) and the Python
  functions (bytecodes executed, self and inclusive) whose counts differ most
  from the base's.
* :func:`unnamed_rows`: every row of a stage of the series above :data:`NAMED`
  (1.00 of the base) has a profile that names the Python function behind it;
  a row without one fails the command.
* the witness: a copy of the last stage with a deliberate cost in one function
  (:data:`SLOWDOWN`) must show a ratio above the threshold, and its profile
  must name that function; otherwise the command fails.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from hmastack.bench import callgrind
from hmastack.bench.report import ScenarioReport, column
from hmastack.bench.trees import (
    BenchTree,
    Slowdown,
    alternate,
    run_scenario,
)
from hmastack.core.config import Config
from hmastack.stack import env as env_mod
from hmastack.stack import series

THRESHOLD = 1.01  # a ratio above this is a cost, and gets a profile
# A stage's ratio above this must be explained: its profile names the Python
# function behind it (:func:`unnamed_rows`), else the command fails.
NAMED = 1.00
SCENARIO = "scheduler_cost"

LAYOUTS = ("full", "gemma3", "gptoss")
CONNECTORS = ("none", "connector")
MODES = ("decode", "prefill")
SIZES = (64, 256)

# The witness: a deliberate cost in a function every scheduled request reaches.
SLOWDOWN = Slowdown(
    file="vllm/v1/core/kv_cache_manager.py",
    qualname="KVCacheManager.allocate_slots",
    statement="for _hmastack_witness in range(40): pass  # deliberate extra work",
)


def settings(
    layouts: tuple[str, ...] = LAYOUTS,
    connectors: tuple[str, ...] = CONNECTORS,
    modes: tuple[str, ...] = MODES,
    sizes: tuple[int, ...] = SIZES,
) -> list[dict]:
    return [
        {"layout": lay, "connector": con, "mode": mode, "requests": n}
        for lay in layouts
        for con in connectors
        for mode in modes
        for n in sizes
    ]


# One request of 124k tokens decoding in one sliding-window group (W=4096),
# with a connector that has the request_blocks_freed hook: a per-step cost
# that grows with the request's length (a scan of its block table) shows here.
LONG_SETTING = {
    "layout": "longswa",
    "connector": "hook",
    "mode": "decode",
    "requests": 1,
}
# vLLM's OffloadingConnector (its worker side between the measured calls),
# which stores every full block and holds the blocks its stores read: one
# full-attention group decoding and prefilling, and the long request in a
# sliding window (a store's bookkeeping that grew with the request shows).
OFFLOAD_SETTINGS = [
    {"layout": "full", "connector": "offload", "mode": mode, "requests": 64}
    for mode in MODES
] + [{"layout": "longswa", "connector": "offload", "mode": "decode", "requests": 1}]
# The full set: the full-attention layout in every combination, the hybrid
# layouts with external hits (the connector), where the series' paths run,
# OffloadingConnector, and the long request. 64 requests first: the witness
# settings are then the first ones of a run.
ALL_SETTINGS = sorted(
    settings(layouts=("full",))
    + settings(layouts=("gemma3", "gptoss"), connectors=("connector",))
    + OFFLOAD_SETTINGS[:-1],
    key=lambda s: s["requests"],
) + [LONG_SETTING, OFFLOAD_SETTINGS[-1]]
# The quick set: 64 requests; the plain full-attention case, the connector's
# prefill path and both hybrid layouts with the connector (where the series'
# code paths run).
QUICK_SETTINGS = [
    {"layout": "full", "connector": "none", "mode": "decode", "requests": 64},
    {"layout": "full", "connector": "connector", "mode": "prefill", "requests": 64},
    {"layout": "gemma3", "connector": "connector", "mode": "decode", "requests": 64},
    {"layout": "gptoss", "connector": "connector", "mode": "prefill", "requests": 64},
]
WITNESS_QUICK = [ALL_SETTINGS[0]]  # full, none, decode, 64


def key(row: dict) -> tuple:
    """What identifies one setting in a run's rows."""
    return (
        row.get("layout", "full"),
        row.get("connector", "none"),
        row["mode"],
        row["requests"],
    )


def label(setting: dict) -> str:
    """The setting's label, as the scenario names its dumps."""
    return "-".join(str(x) for x in key(setting))


# --- ratios ------------------------------------------------------------------------


class RatioRow(msgspec.Struct, kw_only=True):
    """One row of :func:`ratio_rows`: a tree and setting, its figure over the
    runs and its ratio to the base over the rounds."""

    tree: str
    layout: str
    connector: str
    mode: str
    requests: int
    median: float
    min: float
    max: float
    runs: int
    spread: float = column("spread %")
    ratio_median: float = column("ratio median")
    ratio_min: float = column("ratio min")
    ratio_max: float = column("ratio max")
    reps: int
    same_work: bool = column("work = base")


class CostReport(ScenarioReport, kw_only=True):
    """``scheduler_cost.json``: CPU time per step, beside the counts."""

    title: str
    method: str
    unit: str
    steps: int
    errors: dict[str, str]
    rows: list[RatioRow]


def ratio_rows(
    trees: list[str], results: dict[str, list[dict]], value: str
) -> list[dict]:
    """Per tree and setting: the median of ``value`` over the tree's runs, its
    min and max and their spread ((max - min) / median), and the ratio tree/base
    of each round (run i of the tree against run i of the base), as median, min
    and max. ``work = base``: whether the tree scheduled the same tokens and
    finished the same requests as the base (else the ratio compares different
    work)."""
    base = trees[0]
    if not results.get(base):
        return []
    rows = []
    for tree in trees:
        runs = results.get(tree) or []
        if not runs:
            continue
        for r in runs[0]["rows"]:
            k = key(r)
            mine = [x for run in runs for x in run["rows"] if key(x) == k]
            theirs = [x for run in results[base] for x in run["rows"] if key(x) == k]
            values = [x[value] for x in mine]
            ratios = [
                a[value] / b[value]
                for a, b in zip(mine, theirs, strict=False)
                if b[value] > 0
            ]
            if not ratios:
                continue
            med = statistics.median(values)
            same = all(
                (a.get("scheduled_tokens"), a.get("finished"))
                == (theirs[0].get("scheduled_tokens"), theirs[0].get("finished"))
                for a in mine
            )
            rows.append(
                {
                    "tree": tree,
                    "layout": k[0],
                    "connector": k[1],
                    "mode": k[2],
                    "requests": k[3],
                    "median": med,
                    "min": min(values),
                    "max": max(values),
                    "runs": len(values),
                    "spread %": round(100 * (max(values) - min(values)) / med, 4)
                    if med
                    else 0.0,
                    "ratio median": round(statistics.median(ratios), 4),
                    "ratio min": round(min(ratios), 4),
                    "ratio max": round(max(ratios), 4),
                    "reps": len(ratios),
                    "work = base": same,
                }
            )
    return rows


def is_series(tree_label: str) -> bool:
    """A stage of the series, a commit prefix of one (``stage KEY``, ``stage
    KEY.J``) or a slowed copy, not the base nor the peer."""
    return tree_label.startswith("stage ")


def to_profile(row: dict) -> bool:
    """Whether a row of the counts gets a profile: above :data:`THRESHOLD`, or
    a stage of the series above :data:`NAMED`."""
    ratio = row["ratio median"]
    return ratio > THRESHOLD or (is_series(row["tree"]) and ratio > NAMED)


def unnamed_rows(report: dict) -> list[str]:
    """The rows of a stage of the series whose ratio is above :data:`NAMED`
    and whose profile names no Python function (or that have no profile)."""
    named = {
        (p["tree"], p["setting"])
        for p in report.get("profiles", [])
        if p.get("python_functions")
    }
    return [
        f"{r['tree']} {label(r)}: ratio {r['ratio median']} above {NAMED} and "
        "no profile names the function behind it"
        for r in report.get("rows", [])
        if is_series(r["tree"])
        and r["ratio median"] > NAMED
        and (r["tree"], label(r)) not in named
    ]


# --- what a setting is expected to cost --------------------------------------------


def expected_for(
    stages: list[series.Stage], tree_label: str, setting: str
) -> series.BenchExpected | None:
    """The expectation that explains the profile of ``tree_label`` for
    ``setting`` (:func:`label`): the ``[[bench.expected]]`` of that setting
    in the ``stage.toml`` of the tree's stage or the last stage before it
    that has one. None for the base, a commit prefix, the peer or a slowed
    copy, and for a setting no stage expects to cost more. It must stay true:
    a profile that shows none of its functions fails the command
    (:func:`unexplained_profiles`)."""
    found = None
    for s in stages:
        for e in s.info.bench.expected:
            if setting.startswith(f"{e.setting}-"):
                found = e
        if s.label == tree_label:
            return found if s.key != series.BASE else None
    return None


def explain(profiles: list[dict], stages: list[series.Stage]) -> list[dict]:
    """The profiles with the expectation of their setting, where one explains
    them (:func:`expected_for`)."""
    for p in profiles:
        e = expected_for(stages, p["tree"], p["setting"])
        if e is not None:
            p["expected functions"] = list(e.functions)
            p["why"] = e.why
    return profiles


def shown(profile: dict) -> list[str]:
    """The expected functions of a profile that its Python functions show."""
    named = {f["function"] for f in profile.get("python_functions", [])}
    return [f for f in profile.get("expected functions", []) if f in named]


def unexplained_profiles(report: dict) -> list[str]:
    """The profiles whose expectation names functions the profile does not
    show: the expectation no longer explains the row."""
    return [
        f"{p['tree']} {p['setting']}: the expected cost names "
        f"{', '.join(p['expected functions'])}, the profile shows none of them"
        for p in report.get("profiles", [])
        if p.get("expected functions") and p.get("python_functions") and not shown(p)
    ]


# --- CPU time --------------------------------------------------------------------


def cpu_time(
    cfg: Config, pyenv: env_mod.Env, trees: list[BenchTree], plan: dict
) -> dict:
    """CPU ms per step of every setting, ``plan["reps"]`` alternating rounds."""
    args = {"meter": "cpu", "steps": plan["steps"], "settings": plan["settings"]}
    results, errors = alternate(
        trees,
        plan["reps"],
        lambda t, _: run_scenario(cfg, pyenv, t, SCENARIO, args),
    )
    for runs in results.values():
        for run in runs:
            for r in run["rows"]:
                r["cpu_ms_per_step"] = 1000.0 * r["cpu_s"] / r["steps"]
    rows = ratio_rows([t.label for t in trees], results, "cpu_ms_per_step")
    for r in rows:
        for k in ("median", "min", "max"):
            r[k] = round(r[k], 4)
    return {
        "title": "Scheduler CPU time per step (noisy)",
        "method": "time.process_time around schedule()+update_from_output(), "
        "one native process per run, trees alternating; ratio = tree / base per "
        f"round; {plan['reps']} round(s) of {plan['steps']} steps; garbage "
        "collector off during the measured steps; never fails on timing",
        "unit": "CPU ms per step",
        "steps": plan["steps"],
        "errors": errors,
        "rows": rows,
    }


# --- where the cost goes ----------------------------------------------------------


class PythonFunction(msgspec.Struct, kw_only=True):
    """One Python function of a profile (:func:`diff_python`)."""

    function: str
    self_base: int = column("self base")
    self_: int = column("self")
    self_difference: int = column("self difference")
    share: float | None
    inclusive_difference: int = column("inclusive difference")
    calls_base: int = column("calls base")
    calls: int


class CFunction(msgspec.Struct, kw_only=True):
    """One C function of a profile (:func:`callgrind.diff_functions`)."""

    function: str
    base: int
    other: int
    difference: int
    share: float | None


class Profile(msgspec.Struct, kw_only=True):
    """Where one row's cost goes (:func:`_profile`): the C part when both
    trees left callgrind dumps, the Python part when both bytecode runs
    returned the setting."""

    tree: str
    setting: str
    instructions_base: int | None = msgspec.field(
        default=None, name="instructions base"
    )
    instructions: int | None = None
    c_functions: list[CFunction] = []
    bytecodes_base: int | None = msgspec.field(default=None, name="bytecodes base")
    bytecodes: int | None = None
    python_functions: list[PythonFunction] = []
    # The setting's expectation (:data:`EXPECTED`), for a stage it explains.
    expected_functions: list[str] = msgspec.field(
        default_factory=list, name="expected functions"
    )
    why: str = ""


class WitnessRow(msgspec.Struct, kw_only=True):
    """One setting of the witness: its ratio to the stage it copies."""

    layout: str
    connector: str
    mode: str
    requests: int
    ratio_median: float = column("ratio median")


class WitnessReport(msgspec.Struct, kw_only=True):
    """The witness of the counts (:func:`check_witness`); ``why`` when it is
    not caught, its rows once the slowed tree ran, its profiles and the
    functions they name once a ratio is above the threshold."""

    tree: str
    of: str
    slowdown: str
    caught: bool
    why: str = ""
    rows: list[WitnessRow] = []
    profiles: list[Profile] = []
    named: list[str] = []


def _last_dump(runs: list[dict], k: tuple) -> Path | None:
    for run in reversed(runs):
        for r in run["rows"]:
            if key(r) == k and r.get("dump_path"):
                return Path(r["dump_path"])
    return None


def bytecode_profiles(
    cfg: Config, pyenv: env_mod.Env, tree: BenchTree, chosen: list[dict], steps: int
) -> dict[tuple, dict]:
    """Bytecodes per Python function for ``chosen`` settings in ``tree`` (one
    native run, deterministic)."""
    args = {
        "meter": "bytecodes",
        "root": str(tree.path),
        "steps": steps,
        "settings": chosen,
    }
    result = run_scenario(cfg, pyenv, tree, SCENARIO, args)
    return {key(r): r for r in result["rows"]}


def diff_python(base: dict, other: dict, top: int = 8) -> list[dict]:
    """The Python functions whose own bytecodes differ most between two
    bytecode profiles, with their inclusive counts and calls."""
    bf, of = base["functions"], other["functions"]
    delta_total = other["bytecodes"] - base["bytecodes"]
    rows = []
    for name in set(bf) | set(of):
        b = bf.get(name, {"calls": 0, "self": 0, "incl": 0})
        o = of.get(name, {"calls": 0, "self": 0, "incl": 0})
        if o["self"] != b["self"] or o["calls"] != b["calls"]:
            rows.append(
                {
                    "function": name,
                    "self base": b["self"],
                    "self": o["self"],
                    "self difference": o["self"] - b["self"],
                    "share": round((o["self"] - b["self"]) / delta_total, 3)
                    if delta_total
                    else None,
                    "inclusive difference": o["incl"] - b["incl"],
                    "calls base": b["calls"],
                    "calls": o["calls"],
                }
            )
    rows.sort(key=lambda r: (-abs(r["self difference"]), r["function"]))
    return rows[:top]


def profiles(
    cfg: Config,
    pyenv: env_mod.Env,
    trees: list[BenchTree],
    results: dict[str, list[dict]],
    flagged: list[dict],
    plan: dict,
) -> list[dict]:
    """The profile of every flagged row against the base: C functions by
    callgrind self counts (from the dumps of the last round) and Python
    functions by bytecodes (a native run of each tree on its flagged settings)."""
    if not flagged:
        return []
    base = trees[0]
    by_label = {t.label: t for t in trees}
    wanted: dict[str, list[tuple]] = {}
    for r in flagged:
        wanted.setdefault(r["tree"], []).append(key(r))
    union = sorted({k for ks in wanted.values() for k in ks})
    as_setting = lambda k: dict(  # noqa: E731
        zip(("layout", "connector", "mode", "requests"), k, strict=True)
    )
    steps = plan["steps"]
    py_base = bytecode_profiles(cfg, pyenv, base, [as_setting(k) for k in union], steps)
    out = []
    for label_, ks in wanted.items():
        py_tree = bytecode_profiles(
            cfg, pyenv, by_label[label_], [as_setting(k) for k in ks], steps
        )
        for k in ks:
            out.append(
                _profile(
                    label_,
                    k,
                    results[base.label],
                    results[label_],
                    py_base.get(k),
                    py_tree.get(k),
                    cfg,
                )
            )
    return out


def _profile(
    tree_label: str,
    k: tuple,
    base_runs: list[dict],
    tree_runs: list[dict],
    py_base: dict | None,
    py_tree: dict | None,
    cfg: Config,
) -> dict:
    entry: dict[str, Any] = {
        "tree": tree_label,
        "setting": label(
            dict(zip(("layout", "connector", "mode", "requests"), k, strict=True))
        ),
    }
    bpath, tpath = _last_dump(base_runs, k), _last_dump(tree_runs, k)
    if bpath and tpath:
        b, t = callgrind.read_dump(bpath), callgrind.read_dump(tpath)
        entry["instructions base"] = b.total
        entry["instructions"] = t.total
        entry["c_functions"] = callgrind.diff_functions(b.functions, t.functions)
    if py_base and py_tree:
        entry["bytecodes base"] = py_base["bytecodes"]
        entry["bytecodes"] = py_tree["bytecodes"]
        entry["python_functions"] = diff_python(py_base, py_tree)
    return entry


@dataclass(frozen=True)
class Witness:
    """A slowed copy (``tree``) of a stage tree (``of``)."""

    tree: BenchTree
    of: BenchTree


def check_witness(
    cfg: Config,
    pyenv: env_mod.Env,
    witness: Witness,
    runs: dict[str, list[dict]],
    plan: dict,
) -> dict:
    """The witness is caught when some setting's ratio to the stage it copies
    exceeds the threshold and the Python profile of every such setting names
    the slowed function first."""
    tree, of = witness.tree, witness.of
    entry: dict[str, Any] = {"tree": tree.label, "of": of.label, "slowdown": tree.note}
    entry["caught"] = False
    if not runs.get(tree.label):
        entry["why"] = "the slowed tree did not run"
        return entry
    rows = ratio_rows([of.label, tree.label], runs, "instructions_per_step")
    rows = [r for r in rows if r["tree"] == tree.label]
    entry["rows"] = [
        {k: r[k] for k in ("layout", "connector", "mode", "requests", "ratio median")}
        for r in rows
    ]
    above = [r for r in rows if r["ratio median"] > THRESHOLD]
    if not above:
        entry["why"] = f"no ratio above {THRESHOLD}"
        return entry
    found = profiles(cfg, pyenv, [of, tree], runs, above, plan)
    entry["profiles"] = found
    named = [(p.get("python_functions") or [{}])[0].get("function", "") for p in found]
    entry["named"] = named
    entry["caught"] = bool(named) and all(
        n.endswith(":" + SLOWDOWN.qualname) for n in named
    )
    if not entry["caught"]:
        entry["why"] = f"the profile names {named}, not {SLOWDOWN.qualname}"
    return entry
