"""Run scenario processes forked from one parent (for the instruction counts).

Under valgrind, importing vLLM's dependencies (torch, transformers, ...) costs
about a minute and a half of CPU even with instrumentation off. This parent
imports them once (``preload``: third-party modules only, never vLLM, which is
what differs between trees) and then forks one child per run; a child puts its
tree first on ``sys.path``, imports vLLM from it and runs the scenario's
``main()``, its output going to its own file.

Usage: ``python _forkserver.py '{"preload": ["torch", ...]}'``; it prints
``HMASTACK_FORK_DONE {"ready": true, ...}`` once imported. Then one batch per
line on stdin: ``{"parallel": 2, "jobs": [{"id": 0, "tree": "/path", "script":
"scheduler_cost", "args": {...}, "output": "/file"}, ...]}``. Jobs are forked in
order, at most ``parallel`` at a time (instruction counts of one process do not
depend on another running); each ending child is reported as
``HMASTACK_FORK_DONE {"id": ..., "pid": ..., "exit": ...}``, the batch with
``HMASTACK_FORK_DONE {"batch": true}``. End of input ends it.
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


def child(job: dict) -> int:
    """In the forked child: the job's output to its file, its tree first on
    ``sys.path``, the scenario's ``main()``."""
    fd = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    tree = job["tree"]
    try:
        os.chdir(tree)
        sys.path.insert(0, tree)
        importlib.invalidate_caches()
        sys.argv = [job["script"], json.dumps(job.get("args", {}))]
        importlib.import_module(job["script"]).main()
        return 0
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def report(payload: dict) -> None:
    print(DONE + json.dumps(payload), flush=True)


def run_batch(jobs: list[dict], parallel: int) -> None:
    running: dict[int, dict] = {}
    queue = list(jobs)
    while queue or running:
        while queue and len(running) < max(1, parallel):
            job = queue.pop(0)
            pid = os.fork()
            if pid == 0:
                os._exit(child(job))
            running[pid] = job
        pid, status = os.wait()
        job = running.pop(pid)
        report({"id": job["id"], "pid": pid, "exit": os.waitstatus_to_exitcode(status)})
    report({"batch": True})


def main() -> None:
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    failed = preload(config.get("preload", []))
    report({"ready": True, "preload_failed": failed})
    for line in sys.stdin:
        if line.strip():
            batch = json.loads(line)
            run_batch(batch["jobs"], int(batch.get("parallel", 1)))


if __name__ == "__main__":
    main()
