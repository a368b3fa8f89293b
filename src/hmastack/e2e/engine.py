"""The engine processes: the support code on their path, their environment, one
process under a watchdog (``run_engine_process``, used by the end-to-end runs and
the throughput benchmark), and the tiny models they load.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hmastack.core import process
from hmastack.core.config import Config
from hmastack.core.process import run
from hmastack.core.progress import step
from hmastack.e2e.environment import env_python
from hmastack.stack import env as env_mod

MODELS_SOURCE = env_mod.TESTKIT / "hmastack_testkit" / "e2e" / "models.py"


def engine_support(cfg: Config) -> list[Path]:
    """Our code an engine process imports, after the trees on ``PYTHONPATH``:
    ``support/testkit`` (``hmastack_testkit``, the engine side in
    ``hmastack_testkit.e2e``)."""
    return [cfg.root / env_mod.TESTKIT]


def engine_environ(
    trees: dict[str, Path], support: list[Path], seed: str
) -> dict[str, str]:
    """The variables every engine process runs with (facts: e2e-facts.md);
    ``support``: :func:`engine_support`."""
    return {
        "PYTHONPATH": os.pathsep.join(
            str(p) for p in (trees["vllm"], trees["lmcache"], *support)
        ),
        "PYTHONHASHSEED": seed,
        "TORCH_COMPILE_DISABLE": "1",
        # vLLM 0.13.0 turns HMA off for chunked local attention unless this is
        # set (a latency concern on GPU); the Llama-4-like model needs it on.
        "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@dataclass
class EngineRun:
    """What one engine process left behind."""

    result: dict | None  # its JSON output; None: none, or not JSON
    returncode: int  # -9 when the watchdog killed it
    hung: bool  # killed by the watchdog after ``timeout`` seconds
    seconds: float  # wall clock, start to exit
    log: Path  # its stdout and stderr


def run_engine_process(
    cfg: Config,
    module: str,
    name: str,
    plan: dict,
    trees: dict[str, Path],
    support: list[Path],
    workdir: Path,
    seed: str,
    timeout: float,
) -> EngineRun:
    """``python -m module <name>.plan.json <name>.out.json`` in the end-to-end
    environment, in its own session (``engine_environ``; ``seed`` its
    ``PYTHONHASHSEED``), output to ``<name>.log``, all in ``workdir``. A
    watchdog kills the whole session after ``timeout`` seconds. Never raises
    for the child's failure: the caller reads :class:`EngineRun`."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file = workdir / f"{name}.plan.json"
    out_file = workdir / f"{name}.out.json"
    log_file = workdir / f"{name}.log"
    out_file.unlink(missing_ok=True)
    plan_file.write_text(json.dumps(plan, indent=1))
    env = engine_environ(trees, support, seed)
    start = time.monotonic()
    with log_file.open("w") as log:
        child = process.start(
            [env_python(cfg), "-m", module, plan_file, out_file],
            stdout=log,
            env=env,
            session=True,
        )
        hung = process.wait(child, timeout)
    seconds = time.monotonic() - start
    try:
        result = json.loads(out_file.read_text())
    except (OSError, ValueError):
        result = None
    return EngineRun(result, child.returncode, hung, seconds, log_file)


def ensure_models(cfg: Config, dest: Path, names: set[str]) -> Path:
    """Generate the tiny models (seeded) into ``dest`` once per models.py."""
    key = hashlib.sha256((cfg.root / MODELS_SOURCE).read_bytes()).hexdigest()
    key_file = dest / ".key"
    todo = sorted(n for n in names if not (dest / n / "config.json").is_file())
    if key_file.is_file() and key_file.read_text() == key and not todo:
        return dest
    with step(f"generate the tiny models ({', '.join(sorted(names))})"):
        tmp = dest.with_name(dest.name + ".tmp")
        if tmp.exists():
            rmtree(tmp)
        run(
            [env_python(cfg), "-m", "hmastack_testkit.e2e.models", tmp, *sorted(names)],
            env={"PYTHONPATH": str(cfg.root / env_mod.TESTKIT), "OMP_NUM_THREADS": "1"},
            log=cfg.build / "logs" / "e2e-models.log",
        )
        if dest.exists():
            rmtree(dest)
        tmp.rename(dest)
        key_file.write_text(key)
    return dest


def rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
