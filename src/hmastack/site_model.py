"""Read the TLA+ model for the site: header, constants, variables, actions,
properties (from ``spec/*.tla``), model configurations (``spec/models/*.cfg``), and
render a TLC trace as a table of block tables.

The reader only looks at comments and declarations laid out as the spec lays them
out (tlaplus/Examples style); what it cannot find is left out of the page.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SpecInfo:
    path: Path
    module: str
    header: str = ""
    constants: list[tuple[str, str]] = field(default_factory=list)
    variables: list[tuple[str, str]] = field(default_factory=list)
    actions: list[tuple[str, str]] = field(default_factory=list)
    # (name, "invariant" | "temporal", comment)
    properties: list[tuple[str, str, str]] = field(default_factory=list)


def _comment_text(lines: list[str]) -> str:
    return " ".join(ln.strip() for ln in lines if ln.strip())


def read_spec(path: Path) -> SpecInfo:
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    m = re.search(r"MODULE\s+(\w+)", text)
    info = SpecInfo(path, m.group(1) if m else path.stem)
    # Header: the first (* ... *) box, its frame stripped.
    box = re.search(r"\(\*{5,}\)\n(.*?)\n\(\*{5,}\)", text, flags=re.S)
    if box:
        body = [
            re.sub(r"^\(\*\s?|\s*\*\)$", "", ln).rstrip() for ln in box[1].splitlines()
        ]
        info.header = "\n".join(body).strip("\n")
    # CONSTANTS block: "Name,  \* comment" lines until a blank line.
    for i, line in enumerate(lines):
        if line.strip() == "CONSTANTS":
            for row in lines[i + 1 :]:
                if not row.strip():
                    break
                if c := re.match(r"\s+(\w+),?\s*(?:\\\*\s*(.*))?$", row):
                    info.constants.append((c[1], c[2] or ""))
            break
    # PlusCal "variables" block: "\* comment" lines, then "name = ...".
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "variables"), None)
    pending = []
    for line in lines[start + 1 :] if start is not None else []:
        s = line.strip()
        if s.startswith("define") or s.startswith("begin"):
            break
        if s.startswith("\\*"):
            pending.append(s[2:].strip())
        elif v := re.match(r"(\w+)\s*=", s):
            info.variables.append((v[1], _comment_text(pending)))
            pending = []
    # Actions: the event each step records, described by the comment that
    # opens its either/or branch, or else by the comment over its process.
    pending, after_branch, branch, process = [], False, "", ""
    seen: set[str] = set()
    for line in lines:
        s = line.strip()
        if s.startswith("\\*"):
            if not re.fullmatch(r"\\\*\s*-*", s):
                pending.append(s[2:].strip())
            continue
        if pending:
            if after_branch:
                branch = _comment_text(pending)
            elif re.match(r"^(fair\+?\s+)?process\b", s):
                process, branch = _comment_text(pending), ""
            pending = []
        after_branch = s in ("either", "or")
        if after_branch:
            branch = ""
        for name in re.findall(r'\bEv\("(\w+)"', s):
            if name not in seen:
                seen.add(name)
                info.actions.append((name, branch or process))
    # Properties: THEOREM Spec => []P (invariant) or => P (temporal), with the
    # comment above P's definition.
    comments: dict[str, str] = {}
    pending = []
    for line in lines:
        s = line.strip()
        if s.startswith("\\*"):
            pending.append(s[2:].strip())
        elif d := re.match(r"^(\w+)\s*==", line):
            comments[d[1]] = _comment_text(pending)
            pending = []
        else:
            pending = [] if s else pending
    for t in re.finditer(r"^THEOREM\s+\w+\s*=>\s*(\[\])?\s*(\w+)", text, flags=re.M):
        kind = "invariant" if t[1] else "temporal"
        info.properties.append((t[2], kind, comments.get(t[2], "")))
    return info


@dataclass
class ModelConfig:
    name: str
    path: Path
    constants: dict[str, str] = field(default_factory=dict)
    invariants: list[str] = field(default_factory=list)
    properties: list[str] = field(default_factory=list)
    comment: str = ""

    @property
    def policy(self) -> str:
        return self.constants.get("Policy", "").strip('"')

    @property
    def mutation(self) -> str:
        return self.constants.get("Mutation", "none").strip('"')


def read_cfg(path: Path) -> ModelConfig:
    cfg = ModelConfig(path.stem, path)
    section = None
    comments = []
    for line in path.read_text(errors="replace").splitlines():
        s = line.strip()
        if s.startswith("\\*"):
            if section is None:
                comments.append(s[2:].strip())
            continue
        if not s:
            continue
        word = s.split()[0]
        if word in ("CONSTANT", "CONSTANTS", "INVARIANT", "INVARIANTS", "PROPERTY",
                    "PROPERTIES", "SPECIFICATION", "SYMMETRY", "INIT", "NEXT",
                    "CHECK_DEADLOCK", "VIEW", "CONSTRAINT", "CONSTRAINTS"):  # fmt: skip
            section = word.rstrip("S")
            rest = s[len(word) :].strip()
            if rest:
                _cfg_item(cfg, section, rest)
            continue
        _cfg_item(cfg, section, s)
    cfg.comment = _comment_text(comments)
    return cfg


def _cfg_item(cfg: ModelConfig, section: str | None, s: str) -> None:
    if section == "CONSTANT" and "=" in s:
        key, _, value = s.partition("=")
        cfg.constants[key.strip()] = value.strip()
    elif section == "INVARIANT":
        cfg.invariants += s.split()
    elif section == "PROPERTY":
        cfg.properties += s.split()


def read_cfgs(spec_dir: Path) -> dict[str, ModelConfig]:
    folder = spec_dir / "models"
    if not folder.is_dir():
        return {}
    return {p.stem: read_cfg(p) for p in sorted(folder.rglob("*.cfg"))}


# --- traces -------------------------------------------------------------------


def _blocks(value: Any) -> list[Any]:
    if isinstance(value, dict):  # TLC may dump a sequence as {"1": .., "2": ..}
        try:
            return [value[k] for k in sorted(value, key=int)]
        except (TypeError, ValueError):
            return list(value.values())
    if isinstance(value, list | tuple):
        return list(value)
    return []


def _as_set(value: Any) -> set:
    return {str(b) for b in _blocks(value)} if value else set()


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "{" + ", ".join(_fmt(v) for v in value) + "}"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def trace_table(trace: list[dict], violated: str | None = None) -> str:
    """A counterexample step by step: the action of each step and every
    request's block table per group after it (``∅`` the null block, ``↓`` a block
    a connector load writes, ``↑`` one a save reads)."""
    states = [s for s in trace if isinstance(s, dict)]
    if not states:
        return ""
    tables = [s.get("table") for s in states]
    if not all(isinstance(t, dict) for t in tables):
        rows = ["| step | state |", "|---|---|"]
        for i, s in enumerate(states):
            rows.append(f"| {i} | `{_cell(json.dumps(s, sort_keys=True))}` |")
        return "\n".join(rows) + "\n"
    reqs = sorted({r for t in tables for r in t})
    groups = sorted(
        {g for t in tables for r in t.values() if isinstance(r, dict) for g in r}
    )
    head = (
        ["step", "action"] + [f"{r} {g}" for r in reqs for g in groups] + ["free queue"]
    )
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, state in enumerate(states):
        ev = state.get("event") or {}
        act = str(ev.get("act", "")) if isinstance(ev, dict) else str(ev)
        who = ev.get("req", "") if isinstance(ev, dict) else ""
        args = ev.get("args", {}) if isinstance(ev, dict) else {}
        shown = {
            k: v for k, v in (args.items() if isinstance(args, dict) else [])
            if k != "none" and v not in ([], {}, 0, False, "")
        }  # fmt: skip
        action = f"**{act}**" + (f" {who}" if who and who != "none" else "")
        if shown:
            action += (
                " <small>"
                + ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
                + "</small>"
            )
        if violated and i == len(states) - 1:
            action += f" — **violates {violated}**"
        loads = state.get("loads") or {}
        saves = state.get("saves") or {}
        cells = []
        for r in reqs:
            loading = _as_set(loads.get(r)) if isinstance(loads, dict) else set()
            saving = _as_set(saves.get(r)) if isinstance(saves, dict) else set()
            for g in groups:
                blocks = _blocks((tables[i].get(r) or {}).get(g))
                text = []
                for b in blocks:
                    mark = "∅" if str(b) == "0" else str(b)
                    mark += "↓" if str(b) in loading else ""
                    mark += "↑" if str(b) in saving else ""
                    text.append(mark)
                cells.append(f"`{' '.join(text)}`" if text else "")
        free = state.get("freeQ")
        free_text = (
            " ".join(map(str, sorted(_blocks(free), key=str)))
            if free is not None
            else ""
        )
        out.append(
            "| "
            + " | ".join(
                [str(i), _cell(action), *cells, f"`{free_text}`" if free_text else ""]
            )
            + " |"
        )
    return "\n".join(out) + "\n"
