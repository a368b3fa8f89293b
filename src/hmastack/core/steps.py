"""What a pipeline step returns: one function per step, called by its
subcommand and by ``hmastack run`` alike.

Each step module has one ``run_step(cfg, ...)``: it does the work, prints what
the user reads (tables, the report's path, the failures) and returns a
:class:`StepResult`. The subcommand turns it into an exit status; ``hmastack
run`` puts its outcome in the summary. A failure the user can act on (no
network with an empty cache, a patch that does not apply) is raised as
:class:`~hmastack.core.errors.HmastackError` by either.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """``ok``: every check of the step passed; ``outcome``: one line for the
    summary of ``hmastack run``."""

    ok: bool
    outcome: str

    @property
    def exit_status(self) -> int:
        """0 when every check passed, 1 when one failed."""
        return 0 if self.ok else 1
