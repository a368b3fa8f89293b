"""Thin command line on top of the pipeline modules.

Exit status: 0 success, 1 tests or checks failed, 2 a usage or environment error
(an :class:`~hmastack.core.errors.HmastackError`, printed with its hint).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from rich.markup import escape

from hmastack import __version__
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console

# Subcommands live with their pipeline step; each module offers
# ``register(subparsers)`` that adds its parser and sets ``func``.
COMMAND_MODULES = (
    "hmastack.stack.base",
    "hmastack.stack.env",
    "hmastack.stack.workspace",
    "hmastack.matrix.stages",
    "hmastack.spec.models",
    "hmastack.conform.run",
    "hmastack.site.docs",
    "hmastack.bench.run",
    "hmastack.e2e",
    "hmastack.pipeline",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hmastack",
        description=(
            "Materialize vLLM 0.13.0 + LMCache 0.3.11, apply the hybrid KV cache "
            "manager + connector series stage by stage, and test every stage."
        ),
    )
    parser.add_argument("--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # step not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return int(func(args) or 0)
    except HmastackError as exc:
        console.print(f"[red]error:[/red] {escape(exc.message)}")
        if exc.hint:
            console.print(f"[yellow]hint:[/yellow] {escape(exc.hint)}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
