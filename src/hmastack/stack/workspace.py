"""The patch stack: stages on disk, ``apply`` into a tree, ``export`` back.

Layout of ``patches/``::

    patches/NN-slug/README.md            the stage's PR description (required)
    patches/NN-slug/<tree>/NNNN-*.patch  git format-patch files for tree <tree>

The subdirectory names the tree a patch targets (``vllm`` or ``lmcache``). Stages
apply in number order, files in name order. Editing a patch means: ``apply``,
change and commit in ``build/<tree>``, ``export``. A commit's stage is read from
its subject: ``[<title_tag> K/N]`` for the N stages of the series, ``[<title_tag>
follow-up J]`` for a follow-up stage beyond them (stage N + J).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hmastack.core import config as config_mod
from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import am_in_progress, git, git_proc, is_repo
from hmastack.core.progress import console
from hmastack.stack import base as base_mod

STAGE_DIR = re.compile(r"^(?P<num>\d\d)-(?P<slug>[a-z0-9][a-z0-9-]*)$")
UPTO_FILE = "hmastack-upto"
# git format-patch cuts file names at 64 characters by default, which the
# "[Core][<title tag> K/N]" prefix mostly uses up; 200 keeps every subject
# whole and the names well under the usual 255-byte limit.
PATCH_FILENAME_MAX_LENGTH = 200


@dataclass(frozen=True)
class Stage:
    number: int
    slug: str
    path: Path
    patches: dict[str, list[Path]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.number:02d}-{self.slug}"

    def patches_for(self, tree: str) -> list[Path]:
        return self.patches.get(tree, [])


class ApplyError(HmastackError):
    """A patch did not apply; the tree was reset to its base."""


def discover(cfg: Config) -> list[Stage]:
    """The stages under ``patches/``, validated and in order.

    Raises :class:`HmastackError` for a stage without README.md, a patch that
    does not sit in a tree subdirectory, an unknown tree, or a gap in numbering.
    """
    if not cfg.patches.is_dir():
        raise HmastackError(f"{cfg.patches} does not exist")
    stages = []
    for path in sorted(p for p in cfg.patches.iterdir() if p.is_dir()):
        match = STAGE_DIR.match(path.name)
        if not match:
            raise HmastackError(
                f"{path} is not a stage directory",
                "stage directories are named NN-slug, e.g. 01-skipped-tokens",
            )
        if not (path / "README.md").is_file():
            raise HmastackError(
                f"stage {path.name} has no README.md",
                "every stage carries its PR description in README.md",
            )
        stray = sorted(path.glob("*.patch"))
        if stray:
            raise HmastackError(
                f"{stray[0]} does not say which tree it targets",
                f"move it into a tree subdirectory: {', '.join(sorted(cfg.trees))}",
            )
        patches = {}
        for sub in sorted(p for p in path.iterdir() if p.is_dir()):
            if sub.name not in cfg.trees:
                raise HmastackError(
                    f"{sub} names no known tree",
                    f"tree subdirectories are: {', '.join(sorted(cfg.trees))}",
                )
            patches[sub.name] = sorted(sub.glob("*.patch"))
        stages.append(
            Stage(int(match["num"]), match["slug"], path, patches)  # type: ignore[arg-type]
        )
    numbers = [s.number for s in stages]
    if numbers != list(range(1, cfg.num_stages + 1)):
        raise HmastackError(
            f"stages under {cfg.patches} are numbered {numbers}, expected "
            f"1..{cfg.num_stages}",
        )
    return stages


def check_stage_number(cfg: Config, number: int) -> int:
    if not 0 <= number <= cfg.num_stages:
        raise HmastackError(
            f"unknown stage {number}",
            f"stages are 0 (the untouched base) to {cfg.num_stages}",
        )
    return number


# --- apply -----------------------------------------------------------------------


def _first_failed_hunk(output: str, patch: Path) -> str:
    """Describe the first hunk git reported as failing, from git am's output."""
    text = patch.read_text(errors="replace")
    if m := re.search(r"error: patch failed: (?P<file>.+?):(?P<line>\d+)", output):
        file, line = m["file"], int(m["line"])
        header = _hunk_header(text, file, line)
        return f"{file}:{line}" + (f" (hunk {header})" if header else "")
    if m := re.search(r"error: (?P<file>\S+): does not exist in index", output):
        return f"{m['file']} (the file does not exist in the tree)"
    if m := re.search(r"error: (?P<file>\S+): already exists in index", output):
        return f"{m['file']} (the patch creates a file that already exists)"
    if m := re.search(r"corrupt patch at line (?P<line>\d+)", output):
        return f"corrupt patch at line {m['line']} of {patch.name}"
    if "Patch format detection failed" in output or "Patch is empty" in output:
        return f"{patch.name} is not a git format-patch file"
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return lines[0] if lines else "git am failed without a message"


def _hunk_header(patch_text: str, file: str, line: int) -> str | None:
    current = None
    for row in patch_text.splitlines():
        if row.startswith("diff --git "):
            current = row.split(" b/", 1)[-1]
        elif row.startswith("@@") and current == file:
            m = re.match(r"@@ -(\d+)", row)
            if m and int(m.group(1)) == line:
                return row
    return None


def reset_to_base(repo: Path, tree: Tree) -> None:
    if am_in_progress(repo):
        git(repo, "am", "--abort")
    git(repo, "reset", "-q", "--hard", f"refs/tags/{tree.tag}")


def _upto_path(repo: Path) -> Path:
    return Path(git(repo, "rev-parse", "--absolute-git-dir")) / UPTO_FILE


def applied_upto(repo: Path, cfg: Config) -> int:
    """The stage ``apply`` last brought ``repo`` to (all stages if never recorded)."""
    path = _upto_path(repo)
    return int(path.read_text()) if path.exists() else cfg.num_stages


def apply_to(repo: Path, tree: Tree, stages: list[Stage], upto: int) -> int:
    """Reset ``repo`` to its base and ``git am`` the patches of stages 1..upto.

    Returns the number of patches applied. On failure runs ``git am --abort``,
    resets to the base and raises :class:`ApplyError` naming stage, patch file and
    first failing hunk; the tree is never left half-applied.
    """
    count = apply_patches(repo, tree, series_patches(stages[:upto], tree.name))
    _upto_path(repo).write_text(str(upto))
    return count


def series_patches(stages: list[Stage], tree_name: str) -> list[tuple[Stage, Path]]:
    """The patch files of ``stages`` for one tree, in the order they apply."""
    return [
        (stage, patch) for stage in stages for patch in stage.patches_for(tree_name)
    ]


def apply_patches(repo: Path, tree: Tree, patches: list[tuple[Stage, Path]]) -> int:
    """Reset ``repo`` to its base and ``git am`` ``patches`` one by one.

    Returns the number applied. On failure resets to the base and raises
    :class:`ApplyError` naming stage, patch file and first failing hunk.
    """
    reset_to_base(repo, tree)
    for stage, patch in patches:
        # --keep-non-patch: strip only "[PATCH n/m]" from the subject, keep
        # vLLM's "[Core][...]" title tags.
        proc = git_proc(
            repo, "am", "--keep-non-patch", "--committer-date-is-author-date", patch
        )
        if proc.returncode != 0:
            where = _first_failed_hunk(proc.stdout, patch)
            reset_to_base(repo, tree)
            raise ApplyError(
                f"stage {stage.name}: {patch.name} does not apply to {tree.name}: "
                f"{where}",
                f"{repo} was reset to {tree.tag}; rebase the patch (apply the "
                "stages before it, fix, commit, `hmastack export`)",
            )
    return len(patches)


def ensure_safe_to_reset(cfg: Config, tree: Tree, repo: Path, stages: list[Stage]):
    """Refuse to reset a workspace that holds work ``patches/`` does not have."""
    if am_in_progress(repo):
        raise HmastackError(
            f"a `git am` is in progress in {repo}",
            f"finish it, or run `git -C {repo} am --abort`",
        )
    dirty = git(repo, "status", "--porcelain")
    if dirty:
        raise HmastackError(
            f"{repo} has uncommitted changes:\n{dirty}",
            "commit them (and `hmastack export`) or stash them; apply resets the tree",
        )
    drift = [
        d for d in export_tree(cfg, tree, stages, check=True) if d.workspace_has_more
    ]
    if drift:
        raise HmastackError(
            f"{repo} has commits that patches/ does not hold:\n  "
            + "\n  ".join(map(str, drift)),
            "run `hmastack export` to keep them, or `hmastack apply --force` to "
            "discard them (git reflog still finds discarded commits)",
        )


def apply(cfg: Config, upto: int, force: bool = False) -> dict[str, int]:
    """Bring every workspace to stage ``upto``; returns patches applied per tree."""
    check_stage_number(cfg, upto)
    stages = discover(cfg)
    applied = {}
    for tree in cfg.trees.values():
        base_mod.materialize(cfg, tree)
        repo = cfg.workspace(tree.name)
        if not force:
            ensure_safe_to_reset(cfg, tree, repo, stages)
        applied[tree.name] = apply_to(repo, tree, stages, upto)
    return applied


# --- export ----------------------------------------------------------------------


def subject_stage(cfg: Config, subject: str) -> int | None:
    """The stage a commit subject names (see :meth:`Config.stage_tag`), or None.

    ``"[Core][T 3/4] ..."`` is stage 3 and ``"[Core][T follow-up 1] ..."`` stage 5
    of a series of 4 with title tag T. A ``K/N`` tag whose N is not the series'
    number of stages, or whose K exceeds it, names no stage.
    """
    tag = re.escape(cfg.title_tag)
    if m := re.search(rf"\[{tag} (\d+)/(\d+)\]", subject):
        k, n = int(m[1]), int(m[2])
        return k if n == cfg.num_series_stages and 1 <= k <= n else None
    if m := re.search(rf"\[{tag} follow-up (\d+)\]", subject):
        return cfg.num_series_stages + int(m[1])
    return None


def commits_by_stage(cfg: Config, tree: Tree, repo: Path) -> dict[int, list[str]]:
    """The workspace's commits above the base, grouped by the stage in their subject."""
    revs = git(repo, "rev-list", "--reverse", f"refs/tags/{tree.tag}..HEAD").split()
    grouped: dict[int, list[str]] = {}
    last = 0
    for commit in revs:
        subject = git(repo, "log", "-1", "--format=%s", commit)
        stage = subject_stage(cfg, subject)
        if stage is None or not 1 <= stage <= cfg.num_stages:
            forms = f"'{cfg.stage_tag(1)}' .. '{cfg.stage_tag(cfg.num_series_stages)}'"
            if cfg.num_followups:
                forms += f" or '{cfg.stage_tag(cfg.num_series_stages + 1)}'"
                if cfg.num_followups > 1:
                    forms += f" .. '{cfg.stage_tag(cfg.num_stages)}'"
            raise HmastackError(
                f"commit {commit[:12]} in {repo} names no stage: {subject!r}",
                f"subjects carry {forms}; squash fixup! commits first "
                "(git rebase -i --autosquash)",
            )
        if stage < last:
            raise HmastackError(
                f"commit {commit[:12]} ({subject!r}) of stage {stage} comes after "
                f"a commit of stage {last}",
                "reorder the commits so stages stay in order",
            )
        last = stage
        grouped.setdefault(stage, []).append(commit)
    return grouped


def render_stage(repo: Path, commits: list[str], out: Path) -> dict[str, bytes]:
    """``git format-patch`` of ``commits`` in a form that export after apply
    reproduces byte for byte: zero commit ids, full index lines, no signature,
    file names from the whole subject (``PATCH_FILENAME_MAX_LENGTH``)."""
    out.mkdir(parents=True, exist_ok=True)
    git(
        repo,
        "format-patch",
        "-q",
        "--zero-commit",
        "--no-signature",
        "--full-index",
        "--no-color",
        f"--filename-max-length={PATCH_FILENAME_MAX_LENGTH}",
        "--start-number",
        "1",
        "-o",
        out,
        f"{commits[0]}^..{commits[-1]}",
    )
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.patch"))}


@dataclass(frozen=True)
class Drift:
    """One file where ``patches/`` and the workspace disagree."""

    path: str
    kind: str  # "missing" | "extra" | "differs"

    TEXT = {
        "missing": "missing (the workspace has it)",
        "extra": "not in the workspace",
        "differs": "differs from the workspace",
    }

    @property
    def workspace_has_more(self) -> bool:
        """True when resetting the workspace would lose this change."""
        return self.kind in ("missing", "differs")

    def __str__(self) -> str:
        return f"{self.path}: {self.TEXT[self.kind]}"


def _compare(
    prefix: str, want: dict[str, bytes], have: dict[str, bytes]
) -> list[Drift]:
    drift = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            drift.append(Drift(f"{prefix}/{name}", "missing"))
        elif name not in want:
            drift.append(Drift(f"{prefix}/{name}", "extra"))
        elif want[name] != have[name]:
            drift.append(Drift(f"{prefix}/{name}", "differs"))
    return drift


def _write(folder: Path, want: dict[str, bytes], have: dict[str, bytes]) -> None:
    for name in set(have) - set(want):
        (folder / name).unlink()
    if want:
        folder.mkdir(exist_ok=True)
    for name, data in want.items():
        (folder / name).write_bytes(data)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def export_tree(cfg: Config, tree: Tree, stages: list[Stage], check: bool) -> list[str]:
    """Export (or with ``check`` compare) one tree's commits; returns the drift."""
    repo = cfg.workspace(tree.name)
    if not is_repo(repo):
        raise HmastackError(
            f"no workspace at {repo}", "run `hmastack apply` (or `hmastack base`)"
        )
    upto = applied_upto(repo, cfg)
    grouped = commits_by_stage(cfg, tree, repo)
    beyond = sorted(s for s in grouped if s > upto)
    if beyond:
        raise HmastackError(
            f"{repo} holds commits of stage {beyond[0]}, but was applied up to "
            f"stage {upto}",
            f"save the commits (`git -C {repo} format-patch -o /tmp/saved "
            f"refs/tags/{tree.tag}..HEAD`), then `hmastack apply --upto "
            f"{beyond[-1]} --force` and `git am --keep-non-patch` them on top",
        )
    drift = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages[:upto]:
            commits = grouped.get(stage.number, [])
            want = (
                render_stage(repo, commits, Path(tmp) / stage.name) if commits else {}
            )
            have = {p.name: p.read_bytes() for p in stage.patches_for(tree.name)}
            stage_drift = _compare(f"patches/{stage.name}/{tree.name}", want, have)
            drift += stage_drift
            if stage_drift and not check:
                _write(stage.path / tree.name, want, have)
    return drift


def export(cfg: Config, check: bool) -> list[Drift]:
    stages = discover(cfg)
    drift = []
    for tree in cfg.trees.values():
        drift += export_tree(cfg, tree, stages, check)
    return drift


# --- CLI -------------------------------------------------------------------------


def cmd_apply(upto: int | None = None, force: bool = False) -> int:
    """``hmastack apply``: stages 1..``upto`` (default: all)."""
    cfg = config_mod.load()
    upto = cfg.num_stages if upto is None else upto
    applied = apply(cfg, upto, force=force)
    for name, count in applied.items():
        head = git(cfg.workspace(name), "rev-parse", "HEAD")
        console.print(f"{name}: {count} patches applied (stages 1..{upto}), {head}")
    return 0


def cmd_export(check: bool = False) -> int:
    cfg = config_mod.load()
    drift = export(cfg, check=check)
    if check:
        if drift:
            console.print("patches/ differs from what `hmastack export` would write:")
            for item in drift:
                console.print(f"  {item}", highlight=False)
            return 1
        upto = {t: applied_upto(cfg.workspace(t), cfg) for t in cfg.trees}
        console.print(
            "patches/ matches the workspace (compared: "
            + ", ".join(f"{t} stages 1..{k}" for t, k in upto.items())
            + ")"
        )
        return 0
    for item in drift:
        console.print(f"  updated {item.path}", highlight=False)
    console.print(f"exported ({len(drift)} files changed)")
    return 0
