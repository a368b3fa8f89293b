"""Behaviours of the model as JSON, for replay against vLLM.

``hmastack spec traces MODEL -n N`` runs TLC in simulation mode
(``-simulate num=N,file=...``). TLC 2.15 writes one file per behaviour,
``<file>_<worker>_<index>``, each a TLA+ module of ``STATE_k ==`` definitions
(conjuncts ``/\\ var = value``, TLC's value syntax). They are parsed with
:mod:`hmastack.spec.tlc`'s value parser into
``build/reports/spec/traces/<model>/trace-NNNN.json`` and its ``index.json``,
of the one schema the replays read them with (:mod:`hmastack_testkit.traces`)::

    {"model": ..., "module": ..., "cfg": ..., "seed": ..., "depth": ..., "index": k,
     "constants": {"N": 5, "Policy": "Series", ...},
     "states": [{"ref": [...], "table": {...}, "event": {...}, ...}, ...]}

Stuttering steps (a state equal to its predecessor: ``Terminating`` at the
end, and TLC 2.15 repeats some states of a simulated behaviour) are dropped.
``MODEL`` is a manifest name (simulated in its module) or a ``.cfg`` path
(simulated in ``--module``, default spec/tlc.toml's module).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hmastack_testkit.traces import Trace, TraceFile, TraceIndex, to_json

from hmastack.core.errors import HmastackError
from hmastack.spec import tlc
from hmastack.spec.cfg import drop_sections, parse_cfg

if TYPE_CHECKING:
    from hmastack.spec.manifest import Settings

__all__ = [
    "counterexample",
    "parse_trace_file",
    "parse_cfg_constants",
    "generate",
    "cmd_traces",
]

DEFAULT_NUM = 20  # behaviours
DEFAULT_DEPTH = 60  # steps per behaviour

_STATE_DEF = re.compile(r"^STATE_(\d+) ==\s*$", re.MULTILINE)
_END = re.compile(r"^={4,}\s*$", re.MULTILINE)
_FILE_INDEX = re.compile(r"_(\d+)_(\d+)$")


def parse_trace_file(text: str) -> list[dict[str, Any]]:
    """The states of one ``-simulate file=`` behaviour, in order.

    Each state is a dict of its variables (parsed TLC values); states equal
    to their predecessor (stuttering) are dropped.
    """
    end = _END.search(text)
    body = text[: end.start()] if end else text
    marks = list(_STATE_DEF.finditer(body))
    if not marks:
        raise tlc.ParseError("no STATE_k definitions in the trace file")
    states = []
    for k, mark in enumerate(marks):
        if int(mark.group(1)) != k + 1:
            raise tlc.ParseError(f"state {mark.group(1)} out of order")
        stop = marks[k + 1].start() if k + 1 < len(marks) else len(body)
        states.append(tlc.parse_state(body[mark.end() : stop])["vars"])
    # A state equal to its predecessor is a stuttering step (TLC 2.15 also
    # repeats some states of a simulated behaviour): it carries no step.
    return [s for k, s in enumerate(states) if k == 0 or s != states[k - 1]]


def parse_cfg_constants(text: str) -> dict[str, Any]:
    """The constants of a cfg (:func:`hmastack.spec.cfg.parse_cfg`), their values
    parsed (TLC's value syntax) and made JSON."""
    return {
        name: tlc.to_jsonable(tlc.parse_value(value))
        for name, value in parse_cfg(text).constants.items()
    }


def _resolve_cfg(
    root: Path, settings: Settings, name: str
) -> tuple[str, Path, str | None]:
    """The name, cfg and module (None: the default) of a model or cfg path."""
    from hmastack.spec import manifest as spec_manifest

    path = Path(name)
    if path.suffix == ".cfg":
        if not path.is_absolute():
            path = (Path.cwd() / path).resolve()
        if not path.is_file():
            raise HmastackError(f"{name} does not exist", "pass a model or a .cfg")
        return path.stem, path, None
    models = spec_manifest.load_manifest(settings)
    if name not in models:
        raise HmastackError(
            f"unknown model {name}", f"known: {', '.join(models)}, or a .cfg path"
        )
    return name, models[name].path, models[name].module


def simulation_cfg(text: str) -> str:
    """The cfg ``text`` TLC simulates: without its SYMMETRY section (symmetry
    sets do not apply to simulation)."""
    return drop_sections(text, {"SYMMETRY"})


def generate(
    cfg: Path,
    name: str,
    num: int,
    depth: int,
    out: Path,
    *,
    seed: int | None = None,
    root: Path | None = None,
    module: str | None = None,
) -> dict[str, Any]:
    """Simulate ``num`` behaviours of ``cfg`` (in ``spec/<module>.tla``,
    default spec/tlc.toml's module); write them as JSON under ``out``.

    Returns a summary (also written as ``out/index.json``).
    """
    from hmastack.spec import install as spec_install
    from hmastack.spec import manifest as spec_manifest
    from hmastack.spec import models as spec

    root = root or spec_manifest.project_root()
    settings = spec_manifest.load_settings(root)
    java = spec_install.find_java()
    jar = spec_install.resolve_jar(root, settings)
    seed = settings.run.seed if seed is None else seed
    module = module or settings.spec.module
    tla_file = settings.spec_dir / f"{module}.tla"
    if not tla_file.is_file():
        raise HmastackError(f"no module {module} in spec/", "pass a spec/*.tla name")
    out = out.resolve()
    work = Path(tempfile.mkdtemp(prefix="hmastack-traces-"))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (work / "sim").mkdir(parents=True)
    spec.copy_modules(settings, work)
    cfg_text = cfg.read_text()
    (work / "model.cfg").write_text(simulation_cfg(cfg_text))
    # One worker: the behaviours depend on the seed only.
    cmd = [
        *spec.tlc_base_command(java, jar, settings, 1, seed, work),
        "-simulate",
        f"num={num},file={work / 'sim' / 'trace'}",
        "-depth",
        str(depth),
        module,
    ]
    run, exit_code, seconds = tlc.run(cmd, work)
    if run.result != "pass":
        what = run.violated or "; ".join(run.errors)[:500] or f"exit {exit_code}"
        raise HmastackError(
            f"TLC simulation of {name} failed: {run.result} ({what})",
            f"see {work / 'tlc.log'}",
        )
    indexed = [
        (tuple(int(x) for x in m.groups()), p)
        for p in (work / "sim").iterdir()
        if (m := _FILE_INDEX.search(p.name))
    ]
    files = [p for _, p in sorted(indexed)]
    constants = parse_cfg_constants(cfg_text)
    cfg_name = str(cfg.relative_to(root)) if cfg.is_relative_to(root) else str(cfg)
    written = []
    for index, path in enumerate(files):
        states = parse_trace_file(path.read_text())
        doc = Trace(
            model=name,
            module=module,
            cfg=cfg_name,
            seed=seed,
            depth=depth,
            index=index,
            constants=constants,
            states=[tlc.to_jsonable(s) for s in states],
        )
        target = out / f"trace-{index:04d}.json"
        target.write_text(json.dumps(to_json(doc), separators=(",", ":")) + "\n")
        written.append(TraceFile(target.name, len(states)))
    summary = to_json(
        TraceIndex(
            model=name,
            module=module,
            cfg=cfg_name,
            seed=seed,
            num=num,
            depth=depth,
            seconds=seconds,
            states_generated=run.states_generated,
            traces=written,
        )
    )
    (out / "index.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return summary


def counterexample(name: str, out: Path, *, root: Path | None = None) -> dict[str, Any]:
    """Run TLC on manifest model ``name`` (a failure) and write its
    counterexample as a trace document (the format of :func:`generate`), so
    that the replays can drive vLLM through it. Returns the document."""
    from hmastack.spec import install as spec_install
    from hmastack.spec import manifest as spec_manifest
    from hmastack.spec import models as spec

    root = root or spec_manifest.project_root()
    settings = spec_manifest.load_settings(root)
    model = spec_manifest.load_manifest(settings).get(name)
    if model is None or model.result == "success":
        raise HmastackError(
            f"{name} is not a model whose manifest entry expects a failure",
            'pick one with result = "... failure" in spec/manifest.toml',
        )
    java = spec_install.find_java()
    jar = spec_install.resolve_jar(root, settings)
    with tempfile.TemporaryDirectory(prefix="hmastack-cex-") as tmp:
        report = spec.run_model(java, jar, settings, model, Path(tmp))
    if not report.ok:
        raise HmastackError(
            f"TLC on {name} misses the manifest: {'; '.join(report.problems)}",
            f"hmastack spec check {name}",
        )
    states = [
        {k: v for k, v in s.items() if not k.startswith("_")}
        for s in report.trace
        if s.get("_step") is not None
    ]
    doc = to_json(
        Trace(
            model=name,
            cfg=str(model.path.relative_to(root)),
            violated=report.violated,
            constants=parse_cfg_constants(model.path.read_text()),
            states=states,
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def cmd_traces(
    model: str,
    n: int = DEFAULT_NUM,
    depth: int = DEFAULT_DEPTH,
    seed: int | None = None,
    counterexample_only: bool = False,
    out: str | None = None,
    module: str | None = None,
) -> int:
    """``hmastack spec traces``: ``n`` behaviours of ``model`` (or, with
    ``counterexample_only``, its counterexample) as JSON."""
    from hmastack.core.progress import console
    from hmastack.spec import manifest as spec_manifest
    from hmastack.spec import models as spec

    if depth < 2:
        raise HmastackError(
            f"--depth {depth} is too small",
            "--depth takes 2 or more (states per behaviour); see hmastack spec "
            "traces --help",
        )
    root, _, reports = spec.paths()
    settings = spec_manifest.load_settings(root)
    if counterexample_only:
        path = Path(out) if out else reports / "spec" / f"{model}.cex.json"
        doc = counterexample(model, path, root=root)
        console.print(
            f"{model}: {doc['violated']} after {len(doc['states'])} states -> {path}"
        )
        return 0
    name, cfg, model_module = _resolve_cfg(root, settings, model)
    folder = Path(out) if out else reports / "spec" / "traces" / name
    summary = generate(
        cfg,
        name,
        n,
        depth,
        folder,
        seed=seed,
        root=root,
        module=module or model_module,
    )
    steps = sum(t["states"] - 1 for t in summary["traces"])
    console.print(
        f"{len(summary['traces'])} behaviours ({steps} steps) of {name} "
        f"in {summary['seconds']} s -> {folder}"
    )
    return 0
