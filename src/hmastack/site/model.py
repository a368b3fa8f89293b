"""Read the TLA+ model for the site: header, constants, variables, actions,
properties (from ``spec/*.tla``; model configurations ``spec/models/*.cfg`` through
:mod:`hmastack.spec.cfg`), and render a TLC trace as a table of block tables.

The reader only looks at comments and declarations laid out as the spec lays them
out (tlaplus/Examples style); what it cannot find is left out of the page.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hmastack.spec.manifest import Model
    from hmastack.spec.models import ModelReport
    from hmastack.stack.series import Counterexample

from hmastack.core.markdown import fence, md_table
from hmastack.spec.cfg import read_cfg


@dataclass
class SpecInfo:
    path: Path
    module: str
    header: str = ""
    constants: list[tuple[str, str]] = field(default_factory=list)
    variables: list[tuple[str, str]] = field(default_factory=list)
    actions: list[tuple[str, str]] = field(default_factory=list)
    # (name, "invariant" | "action" | "temporal", comment, assumptions)
    properties: list[tuple[str, str, str, str]] = field(default_factory=list)
    # (name, comment): the "what the code does today" switches
    switches: list[tuple[str, str]] = field(default_factory=list)


def _comment_text(lines: list[str]) -> str:
    return " ".join(ln.strip() for ln in lines if ln.strip())


def _block_items(lines: list[str], keyword: str) -> list[tuple[str, str]]:
    """``KEYWORD`` followed by ``name, \\* comment`` lines up to a blank line."""
    items: list[tuple[str, str]] = []
    for i, line in enumerate(lines):
        if line.strip() == keyword:
            for row in lines[i + 1 :]:
                if not row.strip():
                    break
                if c := re.match(r"\s+(\w+),?\s*(?:\\\*\s*(.*))?$", row):
                    items.append((c[1], c[2] or ""))
            break
    return items


def _definition_comments(lines: list[str]) -> dict[str, str]:
    """Each top-level definition's name -> the ``\\*`` comment lines above it."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        s = line.strip()
        if s.startswith("\\*"):
            pending.append(s[2:].strip())
        elif d := re.match(r"^(\w+)(?:\(.*?\))?\s*==", line):
            comments[d[1]] = _comment_text(pending)
            pending = []
        else:
            pending = [] if s else pending
    return comments


def read_spec(path: Path) -> SpecInfo:
    """The spec's header box, constants, variables, the actions of ``Next``,
    the "code has" switches and the properties its THEOREMs state, each with
    the comment above its definition (tlaplus/Examples layout)."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    m = re.search(r"MODULE\s+(\w+)", text)
    info = SpecInfo(path, m.group(1) if m else path.stem)
    box = re.search(r"\(\*{5,}\)\n(.*?)\n\(\*{5,}\)", text, flags=re.S)
    if box:
        header = [
            re.sub(r"^\(\*\s?|\s*\*\)$", "", ln).rstrip() for ln in box[1].splitlines()
        ]
        info.header = "\n".join(header).strip("\n")
    info.constants = _block_items(lines, "CONSTANTS")
    info.variables = _block_items(lines, "VARIABLES")
    comments = _definition_comments(lines)
    nxt = re.search(r"^Next ==\n(.*?)(?:\n\S|\Z)", text, flags=re.S | re.M)
    seen: set[str] = set()
    for name in re.findall(r"\b([A-Z]\w*)\(r\)", nxt[1] if nxt else ""):
        if name not in seen:
            seen.add(name)
            info.actions.append((name, comments.get(name, "")))
    switches = r"SaveHold|StallFix|SharedInvalidFix|RangeByComputed|PadExternal"
    for name in re.findall(rf"^({switches}) ==", text, flags=re.M):
        info.switches.append((name, comments.get(name, "")))
    theorem = re.compile(
        r"^THEOREM\s+(?:\((?P<assume>[^)]*)\)\s*=>\s*\()?(?P<spec>\w+)\s*=>\s*"
        r"(?P<box>\[\])?\s*(?P<prop>\w+)",
        flags=re.M,
    )
    for t in theorem.finditer(text):
        prop = t["prop"]
        body = re.search(rf"^{prop} ==\s*(.*)", text, flags=re.M)
        if t["box"]:
            kind = "invariant"
        elif body and body[1].lstrip().startswith("[]["):
            kind = "action"
        else:
            kind = "temporal"
        info.properties.append(
            (prop, kind, comments.get(prop, ""), (t["assume"] or "").strip())
        )
    return info


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


def trace_table(trace: list[dict], violated: str | None = None) -> str:
    """A counterexample step by step: the action of each step and every
    request's block table per group after it (``∅`` the null block, ``↓`` a block
    a connector load writes, ``↑`` one a save reads)."""
    states = [s for s in trace if isinstance(s, dict)]
    if not states:
        return ""
    tables = [t for s in states if isinstance(t := s.get("table"), dict)]
    if len(tables) != len(states):
        return md_table(
            ["step", "state"],
            [[i, f"`{json.dumps(s, sort_keys=True)}`"] for i, s in enumerate(states)],
        )
    reqs = sorted({r for t in tables for r in t})
    groups = sorted(
        {g for t in tables for r in t.values() if isinstance(r, dict) for g in r}
    )
    head = (
        ["step", "action"] + [f"{r} {g}" for r in reqs for g in groups] + ["free queue"]
    )
    rows: list[list[object]] = []
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
        rows.append([i, action, *cells, f"`{free_text}`" if free_text else ""])
    return md_table(head, rows)


# --- the model-results page ---------------------------------------------------


def _witness_rows(
    models: dict[str, Model], reports: dict[str, ModelReport | None]
) -> list[list[str]]:
    rows = []
    for m in models.values():
        report = reports.get(m.name)
        got = report.witnesses if report is not None else {}
        for w, want in m.witnesses.items():
            r = got.get(w)
            rows.append(
                [
                    f"`{m.name}`",
                    f"`Witness{w}`",
                    "" if want is None else str(want),
                    "not run yet"
                    if r is None
                    else (
                        f"{r.result}, {r.trace_length} states"
                        if r.trace_length
                        else r.result
                    ),
                    "" if r is None else ("yes" if r.ok else "**no**"),
                ]
            )
    return rows


def extended_spec(spec_dir: Path, module: str) -> str:
    """The spec a model-checking wrapper checks (tlaplus/Examples' MC module):
    the first ``spec/`` module its EXTENDS names; a module that extends none
    is its own."""
    path = spec_dir / f"{module}.tla"
    text = path.read_text(errors="replace") if path.is_file() else ""
    extends = re.search(r"^EXTENDS\s+(.*)$", text, flags=re.M)
    for name in re.findall(r"\w+", extends[1]) if extends else []:
        if (spec_dir / f"{name}.tla").is_file():
            return name
    return module


def model_page(
    root: Path,
    reports_dir: Path,
    counterexamples: list[Counterexample],
    stage_of: dict[str, str] | None = None,
) -> str:
    """The model-results page: what the spec says, every manifest model with
    the stage that names it (``stage_of``: model -> stage key) and the verdict
    of the last ``hmastack spec check`` (its own ``ok``), and the
    ``counterexamples`` the stages name, step by step."""
    stage_of = stage_of or {}
    from hmastack.spec import manifest as spec_manifest
    from hmastack.spec import models as spec_mod

    spec_dir = root / "spec"
    out = ["# The model: properties and results\n"]
    specs = sorted(spec_dir.glob("*.tla")) if spec_dir.is_dir() else []
    specs = [p for p in specs if "_TTrace_" not in p.name]
    # The spec TLC checks by default first (spec/tlc.toml names its
    # model-checking wrapper); others (EagleHits) are models of their own,
    # listed with the manifest's models. No spec/tlc.toml: the first module.
    checked = (
        spec_manifest.load_settings(root).spec.module
        if (spec_dir / "tlc.toml").is_file()
        else None
    )
    main = extended_spec(spec_dir, checked) if checked else None
    specs.sort(key=lambda p: p.stem != main)
    if not specs:
        out.append('!!! note "No model yet"\n    `spec/` holds no TLA+ module yet.\n')
        return "\n".join(out)
    info = read_spec(specs[0])
    wrapper = (
        f" TLC checks it through `spec/{checked}.tla`, its model-checking "
        "wrapper: the mutations (the one definition each replaces, named in "
        "its cfg) and the witnesses."
        if checked and checked != info.module
        else ""
    )
    out.append(
        f"Generated from `spec/{specs[0].name}` (module `{info.module}`), "
        "`spec/models/*.cfg`, `spec/manifest.toml` and the last reports of "
        f"`hmastack spec check`.{wrapper}\n"
    )
    if info.header:
        out += ["## What is modelled\n", fence(info.header, "text")]

    def section(
        title: str, intro: str, header: list[str], rows: list[tuple[str, str]]
    ) -> list[str]:
        if not rows:
            return []
        return [title, intro, md_table(header, [[f"`{n}`", c] for n, c in rows])]

    out += section("## Constants\n", "", ["constant", "meaning"], info.constants)
    out += section("## State\n", "", ["variable", "stands for"], info.variables)
    out += section(
        "## The series: allocation alone and as coded\n",
        '`Policy = "SeriesAsCoded"` models the commits of the series, '
        '`"SeriesAllocOnly"` its per-group allocation alone (none of the '
        "mechanisms below). Each mechanism, with the patch that brings it:\n\n",
        ["switch", "mechanism"],
        info.switches,
    )
    out += section("## Actions\n", "", ["action", "what it models"], info.actions)
    if info.properties:
        kinds = {"invariant": "Spec => []{}", "action": "Spec => {} (action property)",
                 "temporal": "FairSpec => {}"}  # fmt: skip
        out += ["## Properties\n", md_table(
            ["property", "checked as", "under", "states that"],
            [[f"`{n}`", "`" + kinds[k].format(n) + "`", f"`{a}`" if a else "always", c]
             for n, k, c, a in info.properties])]  # fmt: skip
    # A spec/manifest.toml or spec/tlc.toml that is missing or does not match
    # its schema is an error naming the file (the site step fails).
    models = spec_manifest.load_manifest(spec_manifest.load_settings(root))
    reports = {n: spec_mod.read_report(reports_dir, n) for n in models}
    rows = []
    for name, m in models.items():
        mc = read_cfg(m.path) if m.path.is_file() else None
        r = reports[name]
        want = m.result + (f" ({m.prop})" if m.prop and m.result != "success" else "")
        if r is None:
            got, size, verdict = "not run yet", "", ""
        else:
            got = r.result + (f" ({r.violated})" if r.violated else "")
            if r.result == "success" and r.distinct_states is not None:
                size = (f"{r.distinct_states:,} / {r.generated_states or 0:,}, "
                        f"depth {r.depth}")  # fmt: skip
            elif r.trace_length:
                size = f"trace of {r.trace_length} states"
            else:
                size = f"{r.generated_states or 0:,} states generated"
            verdict = "yes" if r.ok else "**no**"
        rows.append([
            f"`{name}`", stage_of.get(name, ""),
            (mc.policy if mc else ""), (mc.mutation if mc else ""),
            (mc.constants.get("SaveMode", "").strip('"') if mc else ""),
            m.mode + (" (nightly)" if m.size == "nightly" else ""),
            "on" if m.deadlock else "off", want, got, size,
            "" if r is None else f"{r.seconds:.0f}", verdict,
        ])  # fmt: skip
    out += [
        "## Model results\n",
        "Sizes are distinct / generated states and the depth of the search "
        "(exhaustive successes) or the length of the counterexample (failures). "
        "The last column is the check's own verdict against the manifest.\n\n",
        md_table(["model", "stage", "policy", "mutation", "saves", "mode", "deadlock",
                  "expected", "TLC", "size", "seconds", "as the manifest says"],
                 rows),
    ]  # fmt: skip
    if all(r is None for r in reports.values()):
        out.append(
            "\nNot run yet: `hmastack spec check` writes "
            "`build/reports/spec/<model>.json`.\n"
        )
    witness_rows = _witness_rows(models, reports)
    if witness_rows:
        out += [
            "## Witnesses: each property can bite\n",
            "A witness `WitnessX` says \"X never happens\"; TLC must find it violated "
            "in the model that lists it, so that the model's properties are checked "
            "where they matter (a hold, a preemption of another request, an "
            "eviction, a window table at its bound, null padding for external "
            "tokens, each load-failure branch, a draft token). The length is that of "
            "the shortest way there.\n\n",
            md_table(["model", "witness", "manifest (states)", "TLC", "as expected"],
                     witness_rows),
        ]  # fmt: skip
    out.append("## Counterexamples, step by step\n")
    out.append(
        "Each row is one step: the action (the vLLM method it stands for) and every "
        "request's block table per KV cache group after it. `∅` is the null block, "
        "`↓` marks a block a connector load is writing into, `↑` one a connector "
        "store is reading.\n"
    )
    for example in counterexamples:
        name, title, meaning = example.model, example.title, example.meaning
        r = reports.get(name)
        out.append(f"### {title} (`{name}`) {{#{name}}}\n")
        out.append(meaning + "\n")
        if r is None or not r.trace:
            out.append("\nNot run yet.\n")
            continue
        out.append(trace_table(r.trace, r.violated))
    return "\n".join(out)


def manifest_table(root: Path) -> str:
    """Every manifest model with what the manifest records for it (the run that
    recorded it), for docs/model.md."""
    from hmastack.spec import manifest as spec_manifest

    if not (root / "spec" / "manifest.toml").is_file():
        return "No model yet: there is no `spec/manifest.toml`.\n"
    # One that does not match its schema is an error naming the file.
    models = spec_manifest.load_manifest(spec_manifest.load_settings(root))
    rows = []
    for name, m in models.items():
        mc = read_cfg(m.path) if m.path.is_file() else None
        want = m.result + (f" ({m.prop})" if m.prop and m.result != "success" else "")
        if m.result == "success" and m.distinct_states is not None:
            size = f"{m.distinct_states:,} / {m.generated_states:,}, depth {m.depth}"
        elif m.trace_length:
            size = f"trace of {m.trace_length} states"
        else:
            size = ""
        rows.append([
            f"`{name}`", (mc.policy if mc else ""),
            (mc.constants.get("SaveMode", "").strip('"') if mc else ""),
            m.mode + (" (nightly)" if m.size == "nightly" else ""),
            "on" if m.deadlock else "off", want, size,
            ", ".join(f"{w} ({n})" for w, n in m.witnesses.items()),
            m.comment or (mc.comment if mc else ""),
        ])  # fmt: skip
    return md_table(
        ["model", "policy", "saves", "mode", "deadlock", "expected", "states",
         "witnesses (states)", "what it is"], rows)  # fmt: skip
