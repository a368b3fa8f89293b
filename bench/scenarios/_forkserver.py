"""Run scenario processes forked from one parent (for the instruction counts).

Under valgrind, importing vLLM's dependencies (torch, transformers, ...) costs
about a minute and a half of CPU even with instrumentation off. This parent
imports them once (``preload``: third-party modules only, never vLLM, which is
what differs between trees) and then forks one child per run; a child puts its
tree first on ``sys.path``, imports vLLM from it and runs the scenario's
``main()``. Every child of one parent starts from the same state.

Usage: ``python _forkserver.py '{"preload": ["torch", ...]}'``, then one JSON
command per line on stdin: ``{"tree": "/path", "script": "scheduler_cost",
"args": {...}}``. For each, the child's output goes to stdout followed by one
line ``HMASTACK_FORK_DONE {"pid": ..., "exit": ...}``. End of input ends it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

DONE = "HMASTACK_FORK_DONE "


def preload(modules: list[str]) -> list[str]:
    """Import ``modules``; return those that failed. vLLM must stay unimported."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module the tree may not need
            failed.append(name)
        if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
            raise SystemExit(f"preloading {name} imported vllm: leave it out")
    return failed


def child(command: dict) -> int:
    tree = command["tree"]
    os.chdir(tree)
    sys.path.insert(0, tree)
    importlib.invalidate_caches()
    sys.argv = [command["script"], json.dumps(command.get("args", {}))]
    try:
        importlib.import_module(command["script"]).main()
        return 0
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    failed = preload(config.get("preload", []))
    print(DONE + json.dumps({"ready": True, "preload_failed": failed}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(child(command))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(DONE + json.dumps({"pid": pid, "exit": code}), flush=True)


if __name__ == "__main__":
    main()
