"""The stage matrix: for k = 0..N, apply stages 1..k and run every check.

Each stage k gets its own clones of the trees under ``build/stages/k/`` (the
workspaces in ``build/<tree>`` are never touched), and runs:

* the selected vLLM suite of the patched vLLM tree (``[suite] vllm`` in
  ``hmastack.toml``) minus the entries of ``env/deselected.toml``;
* at the stages that patch LMCache, LMCache's own tests (``[suite] lmcache``)
  from the patched LMCache tree, with LMCache's own pytest configuration;
* our own stage tests ``tests/stages/sNN_*`` for every NN <= k;
* ``ruff check`` and ``ruff format --check`` with each tree's own configuration and
  pinned ruff, on the Python files the stages touch.

Results go to ``build/reports/stages.json`` and a table on the terminal.
"""

from __future__ import annotations

import argparse
import re
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hmastack import base as base_mod
from hmastack import config as config_mod
from hmastack import env as env_mod
from hmastack import reports
from hmastack.config import Config
from hmastack.errors import HmastackError
from hmastack.gitutil import git, is_repo
from hmastack.progress import console, run, step
from hmastack.workspace import Stage, apply_to, check_stage_number, discover

DESELECT_REASONS = ("needs weights", "needs GPU", "needs torchvision", "needs ray")
OUTCOMES = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")


@dataclass
class Deselected:
    node: str
    reason: str
    why: str

    @property
    def is_file(self) -> bool:
        return "::" not in self.node


def load_deselected(path: Path) -> list[Deselected]:
    """The committed list of vLLM tests that cannot run here, each with a reason.

    Raises :class:`HmastackError` for an entry without a known reason or ``why``.
    """
    data = tomllib.loads(path.read_text())
    entries = []
    for item in data.get("deselect", []):
        entry = Deselected(
            item.get("node", ""), item.get("reason", ""), item.get("why", "")
        )
        if not entry.node or entry.reason not in DESELECT_REASONS or not entry.why:
            raise HmastackError(
                f"{path}: entry {item!r} needs a node, a reason among "
                f"{DESELECT_REASONS} and a 'why'",
            )
        entries.append(entry)
    return entries


@dataclass
class PytestResult:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    returncode: int = 0
    log: str = ""

    @property
    def ok(self) -> bool:
        bad = self.counts.get("failed", 0) + self.counts.get("errors", 0)
        return self.returncode in (0, 5) and bad == 0

    def summary(self) -> str:
        c = self.counts
        text = f"{c.get('passed', 0)} passed / {c.get('failed', 0)} failed"
        for key in ("errors", "skipped", "deselected"):
            if c.get(key):
                text += f" / {c[key]} {key}"
        return text


def parse_pytest_output(output: str) -> tuple[dict[str, int], list[str]]:
    """Counts from pytest's closing line and the ids of failed tests.

    ``"3 failed, 287 passed, 9 deselected in 95.1s"`` gives
    ``{"failed": 3, "passed": 287, "deselected": 9}``.
    """
    counts = dict.fromkeys(OUTCOMES, 0)
    closing = [ln for ln in output.splitlines() if re.search(r" in [\d.]+s", ln)]
    if closing:
        for num, word in re.findall(r"(\d+) (\w+)", closing[-1]):
            word = {"error": "errors"}.get(word, word)
            if word in counts:
                counts[word] = int(num)
    # Summary lines name a test node ("FAILED tests/x.py::test_y - ..."); vLLM's own
    # log lines ("ERROR 11-30 09:10:11 ...") do not.
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+\.py(?:::\S+)?)", output, flags=re.M)
    return counts, failures


def run_pytest(
    cfg: Config,
    pyenv: env_mod.Env,
    args: list[str],
    cwd: Path,
    pythonpath: list[Path],
    log: Path,
    extra_env: dict[str, str] | None = None,
) -> PytestResult:
    """pytest in the CPU environment (``pyenv.test_environ`` plus ``extra_env``);
    its output goes to ``log``."""
    cmd = [
        pyenv.python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfE",
        "--timeout=900",
        *args,
    ]
    environ = pyenv.test_environ(pythonpath) | (extra_env or {})
    proc = run(cmd, cwd=cwd, env=environ, log=log, check=False)
    counts, failures = parse_pytest_output(proc.stdout)
    return PytestResult(counts, failures, proc.returncode, str(log))


@dataclass
class StageResult:
    stage: int
    name: str
    patches: dict[str, int]
    heads: dict[str, str]
    vllm: PytestResult | None = None
    lmcache: PytestResult | None = None
    ours: PytestResult | None = None
    ruff: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        parts = [r for r in (self.vllm, self.lmcache, self.ours) if r is not None]
        return all(r.ok for r in parts) and all(
            v in ("ok", "n/a") for v in self.ruff.values()
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def stage_trees(
    cfg: Config, stages: list[Stage], k: int, root: Path | None = None
) -> dict[str, Path]:
    """Clones of every tree at stage ``k`` under ``root/k/`` (``build/stages``),
    reset to the base and brought to stage ``k`` with ``git am`` on every call."""
    trees = {}
    for tree in cfg.trees.values():
        base_mod.materialize(cfg, tree)
        dest = (root or cfg.build / "stages") / str(k) / tree.name
        if not is_repo(dest):
            dest.parent.mkdir(parents=True, exist_ok=True)
            git(
                cfg.root, "clone", "-q", "--no-checkout", cfg.workspace(tree.name), dest
            )
            name, _, email = cfg.base_author.partition("<")
            git(dest, "config", "user.name", name.strip())
            git(dest, "config", "user.email", email.rstrip(">").strip())
        git(dest, "fetch", "-q", "--tags", cfg.workspace(tree.name))
        apply_to(dest, tree, stages, k)
        git(dest, "clean", "-q", "-fdx")
        trees[tree.name] = dest
    return trees


def touched_python_files(repo: Path, tag: str) -> list[str]:
    out = git(repo, "diff", "--name-only", "--diff-filter=ACMR", tag, "HEAD")
    return [line for line in out.splitlines() if line.endswith(".py")]


def run_ruff(cfg: Config, tree_name: str, repo: Path) -> str:
    tree = cfg.tree(tree_name)
    files = touched_python_files(repo, f"refs/tags/{tree.tag}")
    if not files or not tree.ruff:
        return "n/a"
    binary = env_mod.ruff(cfg, tree.ruff)
    check = run([binary, "check", "--no-cache", *files], cwd=repo, check=False)
    fmt = run(
        [binary, "format", "--check", "--no-cache", *files], cwd=repo, check=False
    )
    if check.returncode == 0 and fmt.returncode == 0:
        return "ok"
    log = cfg.reports / "logs" / f"ruff-{tree_name}-{repo.parent.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(check.stdout + "\n" + fmt.stdout)
    return f"FAIL ({log})"


def our_test_args(cfg: Config, targets: list[str]) -> list[str]:
    """pytest arguments that run our stage tests ``targets`` with their own
    pytest.ini (not vLLM's) and ``tests/stages`` as the rootdir."""
    stage_tests = cfg.root / "tests" / "stages"
    return ["-c", str(stage_tests / "pytest.ini"), "--rootdir", str(stage_tests)] + [
        str(t) for t in targets
    ]


def our_stage_tests(cfg: Config, k: int) -> list[Path]:
    root = cfg.root / "tests" / "stages"
    dirs = []
    for path in sorted(root.glob("s[0-9][0-9]_*")):
        if path.is_dir() and int(path.name[1:3]) <= k and any(path.glob("test_*.py")):
            dirs.append(path)
    return dirs


def run_stage(
    cfg: Config,
    pyenv: env_mod.Env,
    stage: int,
    name: str,
    trees: dict[str, Path],
    patches: dict[str, int],
    deselected: list[Deselected],
    vllm_suite: bool = True,
) -> StageResult:
    start = time.monotonic()
    logs = cfg.reports / "logs"
    heads = {t: git(p, "rev-parse", "HEAD") for t, p in trees.items()}
    result = StageResult(stage, name, patches, heads)
    vllm_tree = trees["vllm"]
    with step(f"stage {stage} ({name}): tests", live=False):
        if vllm_suite:
            args = list(cfg.vllm_suite)
            for entry in deselected:
                if entry.is_file:
                    args.append(f"--ignore={entry.node}")
                else:
                    args += ["--deselect", entry.node]
            result.vllm = run_pytest(
                cfg,
                pyenv,
                args,
                vllm_tree,
                [vllm_tree],
                logs / f"stage-{stage}-vllm.log",
            )
        if patches.get("lmcache") and cfg.lmcache_suite:
            # From the LMCache tree: pytest finds LMCache's tests/pytest.ini
            # and tests/conftest.py (its own configuration), and imports the
            # patched vLLM tree.
            result.lmcache = run_pytest(
                cfg,
                pyenv,
                list(cfg.lmcache_suite),
                trees["lmcache"],
                [vllm_tree, trees["lmcache"]],
                logs / f"stage-{stage}-lmcache.log",
            )
        ours = our_stage_tests(cfg, stage)
        if ours:
            result.ours = run_pytest(
                cfg,
                pyenv,
                our_test_args(cfg, [str(p) for p in ours]),
                cfg.root,
                [*trees.values(), cfg.root / "tests" / "stages"],
                logs / f"stage-{stage}-ours.log",
            )
        for tree_name, repo in trees.items():
            result.ruff[tree_name] = run_ruff(cfg, tree_name, repo)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def run_matrix(
    cfg: Config, selected: list[int], jobs: int = 2, vllm_suite: bool = True
) -> list[StageResult]:
    stages = discover(cfg)
    pyenv = env_mod.ensure(cfg)
    deselected = load_deselected(cfg.deselected)
    names = {0: "base"} | {s.number: s.name for s in stages}
    prepared = []
    for k in selected:
        with step(f"stage {k} ({names[k]}): apply stages 1..{k} with git am"):
            trees = stage_trees(cfg, stages, k)
        patches = {t: sum(len(s.patches_for(t)) for s in stages[:k]) for t in cfg.trees}
        prepared.append((k, trees, patches))
    for tree in cfg.trees.values():  # install both ruff versions before threads start
        if tree.ruff:
            env_mod.ruff(cfg, tree.ruff)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [
            pool.submit(
                run_stage,
                cfg,
                pyenv,
                k,
                names[k],
                trees,
                patches,
                deselected,
                vllm_suite,
            )
            for k, trees, patches in prepared
        ]
        results = [f.result() for f in futures]
    return results


def cmd_test(args: argparse.Namespace) -> int:
    cfg = config_mod.load()
    if args.stage is not None:
        selected = [check_stage_number(cfg, args.stage)]
    else:
        selected = list(range(cfg.num_stages + 1))
    results = run_matrix(cfg, selected, jobs=args.jobs, vllm_suite=not args.ours_only)
    path = reports.write_stage_report(cfg, results)
    reports.print_stage_table(results)
    console.print(f"report: {path}")
    for r in results:
        for part in (r.vllm, r.lmcache, r.ours):
            if part is not None and not part.ok:
                console.print(f"stage {r.stage}: see {part.log}", highlight=False)
                for failure in part.failures[:20]:
                    console.print(f"  {failure}", highlight=False)
    return 0 if all(r.ok for r in results) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test",
        help="run the stage matrix: vLLM's suite + our tests + ruff at every stage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--stage", type=int, metavar="K", help="only stage K (0..N)")
    group.add_argument("--all", action="store_true", help="stages 0..N (default)")
    parser.add_argument(
        "--jobs", type=int, default=2, help="stages tested at once (default 2)"
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="skip vLLM's suite; run only our stage tests and ruff",
    )
    parser.set_defaults(func=cmd_test)
