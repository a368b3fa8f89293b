"""Read the reports the site shows: stage matrix, model check, benchmarks.

Every reader tolerates a missing report (the page then says "not run yet") and a
report written by an older or newer version of its producer: the field names are
looked up in one place per report (:func:`normalize_model` for the model check),
so adjusting to a renamed field is a one-line change.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack.core.config import Config
from hmastack.matrix.reports import (
    COMMIT_REPORT,
    HEADERS,
    STAGE_REPORT,
    pytest_counts_summary,
)

# --- stage matrix (build/reports/stages.json, written by `hmastack test`) --------


@dataclass
class StageReport:
    generated: str
    machine: str
    rows: dict[int, dict]  # stage number -> its entry


def load_stage_report(cfg: Config) -> StageReport | None:
    path = cfg.reports / STAGE_REPORT
    try:
        data = json.loads(path.read_text())
        rows = {int(s["stage"]): s for s in data["stages"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return StageReport(
        str(data.get("generated", "")), str(data.get("machine", "")), rows
    )


# --- every commit (build/reports/commits.json, `hmastack test --per-commit`) ----


@dataclass
class CommitReport:
    generated: str
    rows: dict[str, dict]  # patch file name -> its entry


def load_commit_report(cfg: Config) -> CommitReport | None:
    """The per-commit report, keyed by patch file name; None if not run yet or
    unreadable."""
    path = cfg.reports / COMMIT_REPORT
    try:
        data = json.loads(path.read_text())
        rows = {Path(c["patch"]).name: c for c in data["commits"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CommitReport(str(data.get("generated", "")), rows)


def pytest_summary(result: dict | None) -> str:
    """``"292 passed / 15 failed / 2 errors"`` as the terminal table prints it."""
    if not result:
        return "-"
    return pytest_counts_summary(result.get("counts", {}))


STAGE_HEADERS = HEADERS  # the terminal's stage table


def stage_row(entry: dict) -> list[str]:
    patches = ", ".join(f"{n} {t}" for t, n in entry.get("patches", {}).items() if n)
    ruff = ", ".join(f"{t} {v}" for t, v in entry.get("ruff", {}).items() if v != "n/a")
    return [
        f"{entry.get('stage')} {entry.get('name', '')}",
        patches or "-",
        pytest_summary(entry.get("vllm")) if entry.get("vllm") else "skipped",
        pytest_summary(entry.get("lmcache")) if entry.get("lmcache") else "-",
        pytest_summary(entry.get("ours")),
        ruff or "n/a",
        f"{float(entry.get('seconds', 0)):.0f}",
        "green" if entry.get("ok") else "RED",
    ]


def new_failures(entry: dict, base: dict | None) -> list[str]:
    """Failing vLLM tests of a stage that do not fail on the base."""
    mine = set((entry.get("vllm") or {}).get("failures", []))
    theirs = set(((base or {}).get("vllm") or {}).get("failures", []))
    return sorted(f for f in mine - theirs if "::" in f or f.endswith(".py"))


# --- model check (spec/manifest.*, build/reports/spec/<model>.json) --------------


@dataclass
class ModelResult:
    name: str
    result: str = "not run yet"  # "ok" | "violated" | "error" | ...
    violated: str | None = None
    distinct: int | None = None
    generated: int | None = None
    depth: int | None = None
    seconds: float | None = None
    expected: dict[str, Any] = field(default_factory=dict)
    config: str | None = None
    trace: list[dict] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def matches_manifest(self) -> bool | None:
        """Whether the last run agrees with the manifest (None: nothing to compare)."""
        if not self.expected or self.result == "not run yet":
            return None
        want = self.expected
        checks = [
            ("result", self.result),
            ("violated", self.violated),
            ("distinct", self.distinct),
        ]
        compared = [(k, v) for k, v in checks if want.get(k) is not None]
        return all(want[k] == v for k, v in compared) if compared else None


def _first(raw: dict, *names: str) -> Any:
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def normalize_model(name: str, raw: dict) -> ModelResult:
    """One model's result from a report or manifest entry, whatever its field
    names (the only place that knows them)."""
    violated = _first(
        raw, "violated", "violated_property", "property", "invariant", "violation"
    )
    if isinstance(violated, list):
        violated = ", ".join(map(str, violated)) or None
    result = _first(raw, "result", "status", "outcome", "expect", "expected_result")
    seconds = _first(raw, "seconds", "time", "wall_seconds", "duration")
    trace = _first(raw, "trace", "counterexample", "error_trace") or []
    known = {
        "result", "status", "outcome", "expect", "expected_result", "violated",
        "violated_property", "property", "invariant", "violation", "distinct_states",
        "distinct", "states_distinct", "states_generated", "generated", "depth",
        "diameter", "seconds", "time", "wall_seconds", "duration", "trace",
        "counterexample", "error_trace", "cfg", "config", "name", "model",
    }  # fmt: skip
    return ModelResult(
        name=name,
        result=str(result) if result is not None else "not run yet",
        violated=str(violated) if violated else None,
        distinct=_int(_first(raw, "distinct_states", "distinct", "states_distinct")),
        generated=_int(_first(raw, "states_generated", "generated")),
        depth=_int(_first(raw, "depth", "diameter")),
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
        config=_first(raw, "cfg", "config"),
        trace=trace if isinstance(trace, list) else [],
        extra={k: v for k, v in raw.items() if k not in known and _scalar(v)},
    )


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def _manifest_entries(data: Any) -> dict[str, dict]:
    """Model name -> its manifest entry, for the layouts a manifest may use."""
    if isinstance(data, dict) and "models" in data:
        data = data["models"]
    if isinstance(data, dict) and "model" in data and isinstance(data["model"], list):
        data = data["model"]
    if isinstance(data, list):
        out = {}
        for item in data:
            if isinstance(item, dict):
                key = _first(item, "name", "model", "cfg", "config")
                if key:
                    out[Path(str(key)).stem] = item
        return out
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if isinstance(v, dict)}
    return {}


def load_manifest(cfg: Config) -> dict[str, dict]:
    spec = cfg.root / "spec"
    for name in ("manifest.toml", "manifest.json"):
        path = spec / name
        if path.is_file():
            try:
                text = path.read_text()
                data = (
                    tomllib.loads(text) if name.endswith(".toml") else json.loads(text)
                )
            except (ValueError, OSError):
                return {}
            return _manifest_entries(data)
    return {}


def load_models(cfg: Config) -> list[ModelResult]:
    """Every model the manifest names or a .cfg or report exists for, with its
    last result when a report exists."""
    manifest = load_manifest(cfg)
    names = set(manifest)
    names |= {p.stem for p in (cfg.root / "spec" / "models").glob("*.cfg")}
    reports_dir = cfg.reports / "spec"
    reports = {}
    for path in sorted(reports_dir.glob("*.json")) if reports_dir.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            reports[path.stem] = data
    names |= set(reports)
    models = []
    for name in sorted(names):
        result = normalize_model(name, reports.get(name, {}))
        if name in manifest:
            result.expected = {
                k: v
                for k, v in vars(normalize_model(name, manifest[name])).items()
                if k in ("result", "violated", "distinct", "depth")
                and v not in (None, "not run yet")
            }
            result.config = result.config or _first(manifest[name], "cfg", "config")
        models.append(result)
    return models


# --- benchmarks (build/reports/bench/) -------------------------------------------


@dataclass
class Bench:
    name: str
    title: str
    scalars: dict[str, Any]
    rows: list[dict]
    plots: list[Path]


def load_benchmarks(cfg: Config) -> tuple[list[Bench], list[Path]]:
    """Each bench report and its plots (``<name>*.png``); and plots no report names."""
    folder = cfg.reports / "bench"
    if not folder.is_dir():
        return [], []
    plots = sorted(folder.glob("*.png"))
    used: set[Path] = set()
    benches = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            data = {"rows": data} if isinstance(data, list) else {}
        rows: list[dict] = []
        for key in ("rows", "results", "points", "runs", "data"):
            if isinstance(data.get(key), list):
                rows = [r for r in data[key] if isinstance(r, dict)]
                break
        mine = [p for p in plots if p.stem.startswith(path.stem)]
        used.update(mine)
        benches.append(
            Bench(
                name=path.stem,
                title=str(data.get("title") or path.stem.replace("_", " ")),
                scalars={k: v for k, v in data.items() if _scalar(v) and k != "title"},
                rows=rows,
                plots=mine,
            )
        )
    return benches, [p for p in plots if p not in used]
