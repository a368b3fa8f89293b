"""The stage matrix: for the base and each stage, apply the stages up to it and
run every check.

Each stage gets its own clones of the trees under ``build/stages/<key>/`` (the
workspaces in ``build/<tree>`` are never touched), and runs:

* the selected vLLM suite of the patched vLLM tree (``[suite] vllm`` in
  ``hmastack.toml``) minus the entries of ``env/deselected.toml``;
* at the stages that patch LMCache, LMCache's own tests (``[suite] lmcache``)
  from the patched LMCache tree, with LMCache's own pytest configuration;
* our own tests: ``patches/base/tests`` and the ``tests/`` of every stage up
  to it (``patches/KEY-slug/tests``);
* ``ruff check`` and ``ruff format --check`` with each tree's own configuration and
  pinned ruff, on the Python files the stages touch.

Results go to ``build/reports/stages.json`` and a table on the terminal.

``--quick`` (what ``make test`` runs) keeps all of this at the base and at the
last stage (whose trees hold every commit of the series). At each other stage
it runs the
vLLM test files that the stage's own patches add or change and the stage's own
tests (``StageResult.scope`` "own"); ruff and the
LMCache suite as above. What that leaves out (a stage that breaks a test a
later stage mends) is the per-commit run's to find, in ``hmastack run --full``.

``--per-commit`` instead applies the series one commit at a time (plain
``git am`` of the patch files in order, in clones under ``build/commits/``) and
runs, at every commit, the selected vLLM suite (for commits of the vLLM tree)
and ruff with the tree's own configuration on the files touched so far:
``build/reports/commits.json`` and a table. Our stage tests are not run there:
they test whole stages (the stage matrix runs them). Each vLLM commit runs the
whole selected suite (``commits.json`` gives each commit's seconds), two at a
time with ``--jobs 2``, so ``hmastack run --full`` runs it and ``make test``
does not.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.gitutil import git, is_repo, set_identity
from hmastack.core.process import run
from hmastack.core.progress import console, step
from hmastack.core.steps import StepResult
from hmastack.matrix import reports
from hmastack.matrix.pytest_runs import (
    Deselected,
    load_deselected,
    run_pytest,
)
from hmastack.matrix.reports import CommitResult, StageResult
from hmastack.stack import base as base_mod
from hmastack.stack import env as env_mod
from hmastack.stack import series
from hmastack.stack.series import Stage, discover
from hmastack.stack.workspace import apply_patches, apply_to, series_patches

DEFAULT_JOBS = 2  # stages (or commits) tested at once


def stage_trees(
    cfg: Config, stages: list[Stage], k: int, root: Path | None = None
) -> dict[str, Path]:
    """Clones of every tree at stage number ``k`` under ``root/<key>/``
    (``build/stages``), reset to the base and brought to stage ``k`` with
    ``git am`` on every call."""
    trees = {}
    for tree in cfg.trees.values():
        base_mod.materialize(cfg, tree)
        dest = (root or cfg.build / "stages") / series.key_of(stages, k) / tree.name
        if not is_repo(dest):
            dest.parent.mkdir(parents=True, exist_ok=True)
            git(
                cfg.root, "clone", "-q", "--no-checkout", cfg.workspace(tree.name), dest
            )
            set_identity(dest, cfg.series.author)
        git(dest, "fetch", "-q", "--tags", cfg.workspace(tree.name))
        apply_to(dest, tree, stages, k)
        git(dest, "clean", "-q", "-fdx")
        trees[tree.name] = dest
    return trees


def touched_python_files(repo: Path, tag: str) -> list[str]:
    out = git(repo, "diff", "--name-only", "--diff-filter=ACMR", tag, "HEAD")
    return [line for line in out.splitlines() if line.endswith(".py")]


def run_ruff(cfg: Config, tree_name: str, repo: Path, label: str = "") -> str:
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
    log = cfg.reports / "logs" / f"ruff-{tree_name}-{label or repo.parent.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(check.stdout + "\n" + fmt.stdout)
    return f"FAIL ({log})"


def vllm_suite_args(cfg: Config, deselected: list[Deselected]) -> list[str]:
    """pytest arguments of the selected vLLM suite (``[suite] vllm``) minus
    ``env/deselected.toml``: ``--ignore`` for a whole file, ``--deselect`` for
    a test."""
    args = list(cfg.suite.vllm)
    for entry in deselected:
        if entry.is_file:
            args.append(f"--ignore={entry.node}")
        else:
            args += ["--deselect", entry.node]
    return args


def our_test_args(cfg: Config, targets: list[str]) -> list[str]:
    """pytest arguments that run our stage tests ``targets`` with their own
    ``patches/pytest.ini`` (not vLLM's) and ``patches/`` as the rootdir."""
    return ["-c", str(cfg.patches / "pytest.ini"), "--rootdir", str(cfg.patches)] + [
        str(t) for t in targets
    ]


def our_stage_tests(cfg: Config, k: int, own: bool = False) -> list[Path]:
    """The test directories of the base and the stages up to number ``k``
    (with ``own``: of stage ``k`` alone) that hold a test file."""
    chosen = series.everything(cfg)[: k + 1]
    return [
        s.tests
        for s in (chosen[-1:] if own else chosen)
        if any(s.tests.glob("test_*.py"))
    ]


def own_vllm_tests(
    cfg: Config, repo: Path, num_commits: int, deselected: list[Deselected]
) -> list[str]:
    """The test files of the selected vLLM suite that the last ``num_commits``
    commits of ``repo`` (one stage's patches) add or change, minus the files
    ``env/deselected.toml`` ignores and the tests it deselects."""
    if num_commits == 0:
        return []
    out = git(
        repo,
        "diff",
        "--name-only",
        "--diff-filter=AM",
        f"HEAD~{num_commits}",
        "HEAD",
    )
    ignored = {e.node for e in deselected if e.is_file}
    files = [
        path
        for path in out.splitlines()
        if Path(path).name.startswith("test_")
        and path.endswith(".py")
        and any(path.startswith(f"{root.rstrip('/')}/") for root in cfg.suite.vllm)
        and path not in ignored
    ]
    args = []
    for entry in deselected:
        if not entry.is_file and entry.node.split("::")[0] in files:
            args += ["--deselect", entry.node]
    return files + args if files else []


def full_stages(cfg: Config) -> set[int]:
    """The stages that ``--quick`` still tests in full: the base and the last
    stage."""
    return {0, len(discover(cfg))}


def run_stage(
    cfg: Config,
    pyenv: env_mod.Env,
    stage: int,
    name: str,
    trees: dict[str, Path],
    patches: dict[str, int],
    deselected: list[Deselected],
    vllm_suite: bool = True,
    full: bool = True,
    own_patches: int = 0,
) -> StageResult:
    """Every check of stage ``stage`` on its ``trees``; with ``full`` False
    only the vLLM test files of the stage's own ``own_patches`` vLLM commits and
    the stage's own tests (``--quick``)."""
    start = time.monotonic()
    logs = cfg.reports / "logs"
    heads = {t: git(p, "rev-parse", "HEAD") for t, p in trees.items()}
    key = series.everything(cfg)[stage].key
    result = StageResult(key, name, patches, heads, scope="full" if full else "own")
    vllm_tree = trees["vllm"]
    with step(f"{name}: tests", live=False):
        vllm_args = (
            vllm_suite_args(cfg, deselected)
            if full
            else own_vllm_tests(cfg, vllm_tree, own_patches, deselected)
        )
        if vllm_suite and vllm_args:
            result.vllm = run_pytest(
                cfg,
                pyenv,
                vllm_args,
                vllm_tree,
                [vllm_tree],
                logs / f"stage-{key}-vllm.log",
            )
        if patches.get("lmcache") and cfg.suite.lmcache:
            # From the LMCache tree: pytest finds LMCache's tests/pytest.ini
            # and tests/conftest.py (its own configuration), and imports the
            # patched vLLM tree.
            result.lmcache = run_pytest(
                cfg,
                pyenv,
                list(cfg.suite.lmcache),
                trees["lmcache"],
                [vllm_tree, trees["lmcache"]],
                logs / f"stage-{key}-lmcache.log",
            )
        ours = our_stage_tests(cfg, stage, own=not full)
        if ours:
            result.ours = run_pytest(
                cfg,
                pyenv,
                our_test_args(cfg, [str(p) for p in ours]),
                cfg.root,
                list(trees.values()),
                logs / f"stage-{key}-ours.log",
            )
        for tree_name, repo in trees.items():
            result.ruff[tree_name] = run_ruff(cfg, tree_name, repo)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def run_matrix(
    cfg: Config,
    selected: list[int],
    jobs: int = DEFAULT_JOBS,
    vllm_suite: bool = True,
    quick: bool = False,
) -> list[StageResult]:
    stages = discover(cfg)
    pyenv = env_mod.ensure(cfg)
    deselected = load_deselected(cfg.deselected)
    names = {s.number: s.name for s in series.everything(cfg)}
    prepared = []
    for k in selected:
        with step(f"{names[k]}: apply the stages up to it with git am"):
            trees = stage_trees(cfg, stages, k)
        patches = {t: sum(len(s.patches_for(t)) for s in stages[:k]) for t in cfg.trees}
        own = len(stages[k - 1].patches_for("vllm")) if k else 0
        prepared.append((k, trees, patches, own))
    for tree in cfg.trees.values():  # install both ruff versions before threads start
        if tree.ruff:
            env_mod.ruff(cfg, tree.ruff)
    full = full_stages(cfg)
    # The longest runs first (the full stages, the later ones carry more tests),
    # so that the last one to start is short; results in stage order.
    order = sorted(prepared, key=lambda p: (p[0] not in full and quick, -p[0]))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            k: pool.submit(
                run_stage,
                cfg,
                pyenv,
                k,
                names[k],
                trees,
                patches,
                deselected,
                vllm_suite,
                not quick or k in full,
                own,
            )
            for k, trees, patches, own in order
        }
        results = [futures[k].result() for k in sorted(futures)]
    return results


# --- per commit ------------------------------------------------------------------


def _commit_clone(cfg: Config, tree_name: str, slot: int) -> Path:
    """A clone of the workspace of ``tree_name`` for per-commit job ``slot``."""
    dest = cfg.build / "commits" / str(slot) / tree_name
    if not is_repo(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        git(cfg.root, "clone", "-q", "--no-checkout", cfg.workspace(tree_name), dest)
        set_identity(dest, cfg.series.author)
    git(dest, "fetch", "-q", "--tags", cfg.workspace(tree_name))
    return dest


def run_commit(
    cfg: Config,
    pyenv: env_mod.Env,
    tree_name: str,
    patches: list[tuple[Stage, Path]],
    index: int,
    slot: int,
    deselected: list[Deselected],
) -> CommitResult:
    """Apply the first ``index`` of ``patches`` in clone ``slot`` and check."""
    start = time.monotonic()
    tree = cfg.tree(tree_name)
    repo = _commit_clone(cfg, tree_name, slot)
    apply_patches(repo, tree, patches[:index])
    git(repo, "clean", "-q", "-fdx")
    stage, patch = patches[index - 1]
    result = CommitResult(
        tree_name,
        index,
        stage.key,
        patch.name,
        git(repo, "log", "-1", "--format=%s"),
        git(repo, "rev-parse", "HEAD"),
    )
    label = f"commit-{tree_name}-{index:02d}"
    with step(f"{label}: {result.subject[:70]}", live=False):
        if tree_name == "vllm":
            result.vllm = run_pytest(
                cfg,
                pyenv,
                vllm_suite_args(cfg, deselected),
                repo,
                [repo],
                cfg.reports / "logs" / f"{label}.log",
            )
        result.ruff = run_ruff(cfg, tree_name, repo, label)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def run_per_commit(cfg: Config, jobs: int = DEFAULT_JOBS) -> list[CommitResult]:
    """Every commit of every tree, each with the commits before it."""
    stages = discover(cfg)
    pyenv = env_mod.ensure(cfg)
    deselected = load_deselected(cfg.deselected)
    for tree in cfg.trees.values():
        base_mod.materialize(cfg, tree)
        if tree.ruff:
            env_mod.ruff(cfg, tree.ruff)
    tasks = [
        (tree_name, patches, index)
        for tree_name in cfg.trees
        if (patches := series_patches(stages, tree_name))
        for index in range(1, len(patches) + 1)
    ]
    jobs = max(1, jobs)

    def worker(slot: int) -> list[CommitResult]:
        return [
            run_commit(cfg, pyenv, tree_name, patches, index, slot, deselected)
            for tree_name, patches, index in tasks[slot::jobs]
        ]

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = [r for part in pool.map(worker, range(jobs)) for r in part]
    return sorted(results, key=lambda r: (r.tree != "vllm", r.tree, r.index))


def run_step(
    cfg: Config,
    stage: str | None = None,
    per_commit: bool = False,
    jobs: int = DEFAULT_JOBS,
    ours_only: bool = False,
    quick: bool = False,
) -> StepResult:
    """``hmastack test``: every stage, one ``stage``, or every commit."""
    if per_commit:
        commits = run_per_commit(cfg, jobs=jobs)
        path = reports.write_commit_report(cfg, commits)
        reports.print_commit_table(commits)
        console.print(f"report: {path}")
        for c in commits:
            if c.vllm is not None and not c.vllm.ok:
                console.print(f"{c.tree} {c.index}: see {c.vllm.log}", highlight=False)
                for failure in c.vllm.failures[:20]:
                    console.print(f"  {failure}", highlight=False)
        red_commits = [f"{c.tree} {c.index}" for c in commits if not c.ok]
        if red_commits:
            return StepResult(False, f"commits {', '.join(red_commits)} are red")
        return StepResult(True, f"{len(commits)} commits green")
    if stage is not None:
        selected = [series.number(cfg, stage)]
    else:
        selected = list(range(len(discover(cfg)) + 1))
    results = run_matrix(
        cfg, selected, jobs=jobs, vllm_suite=not ours_only, quick=quick
    )
    path = reports.write_stage_report(cfg, results)
    reports.print_stage_table(results)
    console.print(f"report: {path}")
    for r in results:
        for part in (r.vllm, r.lmcache, r.ours):
            if part is not None and not part.ok:
                console.print(f"{r.name}: see {part.log}", highlight=False)
                for failure in part.failures[:20]:
                    console.print(f"  {failure}", highlight=False)
    red = [r.stage for r in results if not r.ok]
    if red:
        return StepResult(False, f"stages {', '.join(red)} are red")
    return StepResult(True, f"stages {', '.join(r.stage for r in results)} green")
