"""Progress output for long steps: what runs, for how long, and how it ended.

On a terminal a live spinner shows the elapsed time; elsewhere (CI logs) a
heartbeat line is printed every ``HEARTBEAT_SECONDS`` so a silent step is never
mistaken for a hung one. Every step ends with one line carrying its wall time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

# Logs (CI) are not terminals: give tables room instead of rich's 80 columns.
console = Console(
    stderr=True,
    highlight=False,
    soft_wrap=True,
    width=None if sys.stderr.isatty() else 160,
)
HEARTBEAT_SECONDS = 60.0


def _format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest:02d} s"


@contextlib.contextmanager
def step(title: str, live: bool = True) -> Iterator[None]:
    """Run a block as a named step with elapsed time.

    Prints ``title ... done (12.3 s)`` or ``... failed`` when the block raises;
    the exception propagates unchanged. ``live=False`` never uses a live display
    (only one may be active at a time: steps running in threads pass it).
    """
    start = time.monotonic()
    stop = threading.Event()
    if live and console.is_terminal:
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        progress.add_task(title)
        progress.start()
    else:
        progress = None
        console.print(f"[bold]>[/bold] {title} ...")

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT_SECONDS):
                elapsed = _format_seconds(time.monotonic() - start)
                console.print(f"  ... {title}: still running ({elapsed})")

        threading.Thread(target=heartbeat, daemon=True).start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        if progress is not None:
            progress.stop()
        elapsed = _format_seconds(time.monotonic() - start)
        if ok:
            console.print(f"[green]✓[/green] {title} ({elapsed})")
        else:
            console.print(f"[red]✗[/red] {title} failed ({elapsed})")
