"""The vLLM trees the benchmarks run on, and how one scenario runs in one tree.

Trees (each a :class:`BenchTree`):

* ``base`` and ``stage KEY``: the base and each stage, clones under
  ``build/bench/stages/<key>/`` re-applied from ``patches/`` on every run;
* ``stage KEY.J``: the first J commits of a stage with several (the last commit
  is ``stage KEY`` itself), under ``build/bench/commits/KEY.J/``;
* ``v0.14.0``: the peer (``[peers.vllm-0-14]`` in ``hmastack.toml``), unpacked
  into ``build/bench/vllm-0.14.0``;
* a *slowed* copy of a stage (:func:`slowed_tree`): the witness that the
  instruction counts and the profiles bite.

A scenario (``bench/scenarios/<name>.py``) runs INSIDE a tree's process: that
tree on ``PYTHONPATH``, the interpreter of ``build/env``; it prints its result as
one JSON line after :data:`MARKER`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hmastack.core import config as config_mod
from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, set_identity
from hmastack.core.process import CommandError, run
from hmastack.stack import base as base_mod
from hmastack.stack import env as env_mod
from hmastack.stack import series

MARKER = "HMASTACK_BENCH_JSON "
PEER_KEY = "vllm-0-14"
PEER_LABEL = "v0.14.0"


@dataclass(frozen=True)
class BenchTree:
    label: str  # "base", "stage KEY", "stage KEY.J", "v0.14.0", "stage KEY slowed"
    path: Path  # the vLLM source tree
    note: str = ""  # what it is, for the report (a commit subject, a mutation)
    # The number of the stage it is (or whose commits it holds part of), 0 the
    # base; None: the peer.
    stage: int | None = None

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "").replace(".", "_")


def parse_stages(text: str | None, cfg: Config, quick: bool = False) -> list[int]:
    """The numbers of the stages to compare with the base: all by default, the
    last with --quick; ``text`` names them by key, ``A..B`` for a range
    (``KEY``, ``FIRST..LAST``, ``KEY,KEY``)."""
    stages = series.everything(cfg)
    if not text:
        return [len(stages) - 1] if quick else list(range(1, len(stages)))
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("..")
        first = series.find(stages, lo).number
        out.update(range(first, series.find(stages, hi or lo).number + 1))
    out.discard(0)
    return sorted(out)


def stage_label(cfg: Config, k: int) -> str:
    """``base`` or ``stage KEY``: the label of the tree of stage number ``k``."""
    return series.everything(cfg)[k].label


def stage_tree(cfg: Config, k: int) -> Path:
    """The vLLM tree at stage number ``k`` under ``build/bench/stages/<key>/``
    (apart from the stage matrix's trees, which may be in use), re-applied from
    ``patches/`` on every run so it is never stale."""
    from hmastack.matrix import stages as matrix

    trees = matrix.stage_trees(
        cfg, series.discover(cfg), k, root=cfg.build / "bench" / "stages"
    )
    return trees["vllm"]


def is_stage(label: str) -> bool:
    """A tree of the series: the base, a stage or a commit prefix of one (not
    the peer, not a slowed copy)."""
    return label == series.BASE or (
        label.startswith("stage ") and not label.endswith(" slowed")
    )


def bench_tree(cfg: Config, k: int) -> BenchTree:
    """The :class:`BenchTree` of stage number ``k``."""
    return BenchTree(stage_label(cfg, k), stage_tree(cfg, k), stage=k)


def commit_trees(cfg: Config, stages: list[int]) -> list[BenchTree]:
    """For each stage number in ``stages`` whose vLLM part has several
    commits, one tree per proper prefix of them (``stage KEY.J``: the stages
    before it and its first J commits), under ``build/bench/commits/KEY.J/``.
    Whatever commits the series has: read from ``patches/`` on every run."""
    from hmastack.stack import workspace

    found = series.discover(cfg)
    tree = cfg.tree("vllm")
    out = []
    for k in stages:
        stage = found[k - 1]
        patches = stage.patches_for("vllm")
        for j in range(1, len(patches)):
            cut = [
                *found[: k - 1],
                dataclasses.replace(stage, patches={"vllm": patches[:j]}),
            ]
            dest = cfg.build / "bench" / "commits" / f"{stage.key}.{j}" / "vllm"
            _clone(cfg, tree, dest)
            workspace.apply_to(dest, tree, cut, k)
            git(dest, "clean", "-q", "-fdx")
            subject = git(dest, "log", "-1", "--format=%s").strip()
            out.append(BenchTree(f"{stage.label}.{j}", dest, subject, stage=k))
    return out


def _clone(cfg: Config, tree: Tree, dest: Path) -> None:
    base_mod.materialize(cfg, tree)
    if not (dest / ".git").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        git(cfg.root, "clone", "-q", "--no-checkout", cfg.workspace(tree.name), dest)
        set_identity(dest, cfg.series.author)
    git(dest, "fetch", "-q", "--tags", cfg.workspace(tree.name))


def insert_statement(source: str, qualname: str, statement: str) -> str:
    """``source`` with ``statement`` as the first statement of function
    ``qualname`` (``Class.method`` or ``function``), after its docstring.
    Raises :class:`HmastackError` if there is no such function."""
    module = ast.parse(source)
    *outer, name = qualname.split(".")
    scope: list[ast.stmt] = module.body
    for part in outer:
        cls = next(
            (n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None
        )
        if cls is None:
            raise HmastackError(f"no class {part} for {qualname}")
        scope = cls.body
    fn = next(
        (
            n
            for n in scope
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ),
        None,
    )
    if fn is None:
        raise HmastackError(f"no function {qualname}")
    body = fn.body
    first = body[1] if ast.get_docstring(fn) is not None and len(body) > 1 else body[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}{statement}\n")
    return "".join(lines)


@dataclass(frozen=True)
class Slowdown:
    """A deliberate cost put into one function of a copy of a stage tree."""

    file: str  # relative to the tree
    qualname: str
    statement: str

    @property
    def describe(self) -> str:
        return f"`{self.statement}` at the start of {self.qualname} ({self.file})"


def slowed_tree(cfg: Config, k: int, slowdown: Slowdown) -> BenchTree:
    """A copy of the bench tree of stage number ``k`` with ``slowdown``
    inserted, under ``build/bench/slowed/``: the instruction count must show it
    (ratio above the threshold) and the profile must name
    ``slowdown.qualname``."""
    src = stage_tree(cfg, k)
    dest = cfg.build / "bench" / "slowed" / "vllm"
    if not (dest / ".git").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        git(cfg.root, "clone", "-q", "--no-checkout", src, dest)
    git(dest, "fetch", "-q", src, "HEAD")
    git(dest, "reset", "-q", "--hard", "FETCH_HEAD")
    git(dest, "clean", "-q", "-fdx")
    path = dest / slowdown.file
    path.write_text(
        insert_statement(path.read_text(), slowdown.qualname, slowdown.statement)
    )
    return BenchTree(f"{stage_label(cfg, k)} slowed", dest, slowdown.describe, k)


def peer_tree(cfg: Config) -> tuple[Path | None, str]:
    """The vLLM 0.14.0 source tree under ``build/bench/``, or None and why not."""
    tree = cfg.peers.get(PEER_KEY)
    if tree is None:
        return None, f"no [peers.{PEER_KEY}] in {config_mod.CONFIG_NAME}"
    dest = cfg.build / "bench" / f"vllm-{tree.version}"
    if not (dest / "vllm" / "__init__.py").is_file():
        try:
            sdist = base_mod.fetch(cfg, tree)
        except HmastackError as exc:
            return None, f"could not fetch {tree.sdist_name}: {exc.message}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (top,) = list(Path(tmp).iterdir())
            shutil.move(str(top), dest)
    return dest, ""


# --- running scenarios -------------------------------------------------------------


def scenario_environ(cfg: Config, pyenv: env_mod.Env, pythonpath: list[Path]) -> dict:
    """The variables of every scenario process: vLLM's offline CPU test settings,
    a fixed hash seed (str/bytes hashes, hence dict and set layouts, are the same
    in every run) and compiled bytecode cached under ``build/bench/pycache`` (the
    trees' sources are compiled once, not in every process)."""
    environ = pyenv.test_environ(pythonpath)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    environ["PYTHONHASHSEED"] = "0"
    environ["PYTHONPYCACHEPREFIX"] = str(cfg.build / "bench" / "pycache")
    return environ


def scenario_script(cfg: Config, name: str) -> Path:
    return cfg.root / "bench" / "scenarios" / f"{name}.py"


def parse_output(stdout: str) -> dict | None:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARKER)]
    return json.loads(lines[-1][len(MARKER) :]) if lines else None


def run_scenario(
    cfg: Config, pyenv: env_mod.Env, tree: BenchTree, name: str, args: dict
) -> dict:
    """Run ``bench/scenarios/<name>.py`` in ``tree``'s process; its result.
    Raises :class:`CommandError` (with the output's tail) if it fails."""
    script = scenario_script(cfg, name)
    proc = run(
        [pyenv.python, script, json.dumps(args)],
        cwd=tree.path,
        env=scenario_environ(cfg, pyenv, [tree.path]),
        log=cfg.build / "logs" / "bench" / f"{name}-{tree.slug}.log",
        check=False,
    )
    result = parse_output(proc.stdout)
    if proc.returncode != 0 or result is None:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CommandError([str(script), tree.label], proc.returncode, tail)
    return result


def round_order(trees: list, i: int) -> list:
    """The order of round ``i``: forward on even rounds, backward on odd ones
    (A B C, C B A, A B C ...), so that no tree always runs first or last in a
    round (a position effect of the machine then does not bias one ratio)."""
    return list(trees) if i % 2 == 0 else list(reversed(trees))


def alternate(
    trees: list[BenchTree], reps: int, run_one: Callable[[BenchTree, int], dict]
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """``run_one(tree, i)`` on every tree in turn, ``reps`` rounds (``i`` the
    round, see :func:`round_order`); the results per tree label in round order,
    and the first error of each tree that failed (it is not run again)."""
    results: dict[str, list[dict]] = {t.label: [] for t in trees}
    errors: dict[str, str] = {}
    for i in range(reps):
        for t in round_order(trees, i):
            if t.label in errors:
                continue
            try:
                results[t.label].append(run_one(t, i))
            except CommandError as exc:
                errors[t.label] = exc.message.splitlines()[-1][:300]
    return results, errors
