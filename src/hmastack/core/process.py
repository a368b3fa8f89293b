"""Run a subprocess with its output captured (and logged); fail with its tail.

The one process runner of the workbench: every step that starts a tool (git,
pip, pytest, ruff, TLC, mkdocs) goes through :func:`run` or raises
:class:`CommandError` the same way.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from hmastack.core.errors import HmastackError


class CommandError(HmastackError):
    """A subprocess failed; carries its exit code and the tail of its output."""

    def __init__(
        self,
        cmd: Sequence[str | os.PathLike],
        returncode: int,
        output: str,
        hint: str | None = None,
    ):
        tail = "\n".join(output.strip().splitlines()[-25:])
        super().__init__(
            f"command failed with exit code {returncode}: {' '.join(map(str, cmd))}"
            + (f"\n--- last lines of its output ---\n{tail}" if tail else ""),
            hint,
        )
        self.cmd = list(cmd)
        self.returncode = returncode
        self.output = output


def run(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    check: bool = True,
    hint: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with stdout and stderr captured together.

    The output is also written to ``log`` when given. Raises
    :class:`CommandError` when ``check`` and the command exits non-zero.
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
    if check and proc.returncode != 0:
        raise CommandError([str(c) for c in cmd], proc.returncode, proc.stdout, hint)
    return proc
