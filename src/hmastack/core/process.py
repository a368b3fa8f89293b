"""Run a subprocess with its output captured (and logged); fail with its tail.

The one process runner of the workbench: every step that starts a tool (git,
pip, pytest, ruff, TLC, mkdocs, valgrind) goes through :func:`run` and raises
:class:`CommandError` the same way; a child the caller talks to or gives a
deadline (the bench's fork server, the e2e engine) is started by :func:`start`
and ended by :func:`wait`. Each gets the caller's environment with ``env`` on top
and its stderr merged into its stdout.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

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
    session: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with stdout and stderr captured together.

    The output is also written to ``log`` when given. Raises
    :class:`CommandError` when ``check`` and the command exits non-zero.
    ``session``: in a session of its own, where a Ctrl-C sent to the caller's
    process group does not reach it (it ends its work; the caller decides).
    """
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=session,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
    if check and proc.returncode != 0:
        raise CommandError([str(c) for c in cmd], proc.returncode, proc.stdout, hint)
    return proc


def start(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | int = subprocess.PIPE,
    stdin: int = subprocess.DEVNULL,
    session: bool = False,
) -> subprocess.Popen[str]:
    """Start ``cmd`` (text mode) writing to ``stdout``, a pipe or a file; with
    ``session`` in a session of its own, so that :func:`wait` ends it with every
    process it started."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=session,
    )


def wait(child: subprocess.Popen[str], timeout: float) -> bool:
    """Wait for ``child`` up to ``timeout`` seconds, then kill it (its session,
    when :func:`start` gave it one); True when it had to be killed."""
    try:
        child.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        except ProcessLookupError:
            pass  # it ended meanwhile
        child.wait()
        return True
