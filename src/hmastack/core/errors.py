"""Errors are values with a message a user can act on."""

from __future__ import annotations


class HmastackError(Exception):
    """A failure the user can act on.

    ``message`` says what went wrong, ``hint`` what to do about it. The CLI
    prints both and exits with ``exit_status``, 2 (status 1 is kept for "tests
    failed").
    """

    exit_status = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class Interrupted(HmastackError):
    """A step stopped on a signal (Ctrl-C, SIGTERM, SIGHUP) after putting back
    what it had changed; the CLI exits with 130, as a shell does for Ctrl-C."""

    exit_status = 130
