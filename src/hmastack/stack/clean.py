"""``hmastack clean`` (``make clean``): delete the build folder, unless a
workspace holds work that ``patches/`` does not.

The build folder is ``build/`` (or ``HMASTACK_BUILD``): the workspaces, the
environments, the reports. A workspace's commits that ``patches/`` does not hold,
its other branches, tags and stashes, uncommitted edits, a git operation in
progress or a lock would go with it for good (its reflog too), so clean names
each one and deletes nothing; the user exports, saves or drops them first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import (
    current_branch,
    git,
    git_proc,
    in_progress,
    index_lock,
    is_repo,
)
from hmastack.core.progress import console
from hmastack.stack import base as base_mod
from hmastack.stack.series import Stage, discover
from hmastack.stack.workspace import (
    describe,
    dirty_paths,
    export_tree,
    git_in,
    held,
    read_state,
)


def _unexported(cfg: Config, tree: Tree, stages: list[Stage]) -> list[str]:
    """What ``build/<tree>`` holds that patches/ does not: a git operation half
    done, a lock, uncommitted edits, HEAD's commits, other branches, tags and
    stashes whose commits are not in HEAD."""
    repo = cfg.workspace(tree.name)
    if not is_repo(repo):
        return []
    if lock := index_lock(repo):
        return [f"{lock} exists: a git process runs in {repo}, or one was killed"]
    found = []
    if op := in_progress(repo):
        found.append(f"{op.what} in progress ({git_in(repo, op.finish)})")
    dirty = dirty_paths(repo)
    if dirty:
        found.append(f"uncommitted changes: {', '.join(dirty[:5])}")
    state = read_state(repo)
    base = base_mod.base_commit(cfg, tree)
    head = git(repo, "rev-parse", "HEAD")
    if head != base and not (op or dirty):
        if (
            state is None
            or state["status"] != "applied"
            or current_branch(repo) is None
        ):
            unheld = not held(cfg, tree, repo, stages, "HEAD")
        else:
            try:
                compared = export_tree(cfg, tree, stages, check=True, for_apply=True)
                unheld = any(d.workspace_has_more for d in compared)
            except HmastackError:
                unheld = True
        if unheld:
            found.append(
                f"HEAD {describe(repo, 'HEAD')}: commits patches/ does not hold"
            )
    refs = git(
        repo,
        "for-each-ref",
        "--format=%(refname) %(objectname)",
        "refs/heads",
        "refs/tags",
        "refs/stash",
    )
    for line in refs.splitlines():
        ref, tip = line.split()
        if ref == f"refs/tags/{tree.tag}" or tip in (head, base):
            continue
        if ref == "refs/stash":
            count = len(git(repo, "stash", "list").splitlines())
            found.append(f"{count} stash entries (`git -C {repo} stash list`)")
            continue
        if git_proc(repo, "merge-base", "--is-ancestor", tip, head).returncode == 0:
            continue
        if not held(cfg, tree, repo, stages, tip):
            found.append(f"{ref.removeprefix('refs/')} at {describe(repo, tip)}")
    return found


def clean(cfg: Config) -> Path | None:
    """Delete the build folder (``HMASTACK_BUILD``, else ``build/``) unless a
    workspace holds work patches/ does not; returns the folder deleted (None:
    there was none)."""
    build = cfg.build
    if not build.exists():
        return None
    if not build.is_dir():
        raise HmastackError(
            f"{build} (the build folder, HMASTACK_BUILD) is not a directory",
            "point HMASTACK_BUILD at the build folder, or unset it",
        )
    resolved = build.resolve()
    if resolved in (Path.home().resolve(), Path(resolved.anchor)) or (
        resolved == cfg.root.resolve() or resolved in cfg.root.resolve().parents
    ):
        raise HmastackError(
            f"{build} holds the project or your home folder; clean deletes only a "
            "build folder",
            "point HMASTACK_BUILD at the build folder, or unset it",
        )
    stages = discover(cfg)
    found = {
        tree.name: items
        for tree in cfg.trees.values()
        if (items := _unexported(cfg, tree, stages))
    }
    if found:
        repo = cfg.workspace(next(iter(found)))
        tag = cfg.trees[next(iter(found))].tag
        raise HmastackError(
            f"{build} holds work that patches/ does not, which clean would delete "
            "for good:\n  "
            + "\n  ".join(
                f"{cfg.workspace(name)}: {item}"
                for name, items in found.items()
                for item in items
            ),
            "export it (`hmastack export`), save it elsewhere (`git -C "
            f"{repo} format-patch -o ~/saved-patches refs/tags/{tag}..BRANCH`), "
            f"or drop it in the workspace (`git -C {repo} branch -D NAME`, `git "
            f"-C {repo} stash drop`, `git -C {repo} checkout -- .`); then clean "
            "again. Nothing was deleted",
        )
    shutil.rmtree(build)
    return build


def cmd_clean(cfg: Config) -> int:
    removed = clean(cfg)
    if removed is None:
        console.print(f"nothing to clean: {cfg.build} does not exist")
    else:
        console.print(f"removed {removed}")
    return 0
