"""The pinned CPU environment the vLLM tests run in.

``build/env`` is a virtualenv with torch (CPU build), vLLM 0.13.0's locked Python
dependencies, the packages that must go in with ``--no-deps``, the KV connectors'
test dependencies (NIXL, ray: ``[env] connectors_lock``, every file checked by
sha256), and our test-support plugin. ``build/hf-home`` is the offline Hugging Face
cache the tests read. Both are rebuilt only when an input changes (the key is a
hash of the inputs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.process import CommandError, run
from hmastack.core.progress import console, step
from hmastack.core.steps import StepResult

BOOTSTRAP = ("setuptools-scm", "wheel", "setuptools>=77,<81")
HF_MODELS = "env/hf-models.json"
# Code shared by the stage tests, the bench scenarios and the e2e engine
# (``hmastack_testkit``): on PYTHONPATH of every process they run in.
TESTKIT = Path("support") / "testkit"


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex (read in chunks)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# --- files of the per-user cache, shared by every clone on the machine ------------

DOWNLOAD_RECORD = ".sha256"  # <file>.sha256: the file's digest when it was downloaded


def record_download(path: Path) -> str:
    """Record the digest of ``path`` as it was downloaded into the cache."""
    digest = sha256_file(path)
    path.with_name(path.name + DOWNLOAD_RECORD).write_text(f"{digest}  {path.name}\n")
    return digest


def check_cached(path: Path, pinned: str, pinned_in: str, hint: str) -> None:
    """Refuse ``path`` unless its sha256 is ``pinned`` (named by ``pinned_in``).

    The cache is shared by every clone on the machine, so one clone's pin never
    moves a file: a file whose content still matches the digest recorded at its
    download stays where it is (another clone may pin it). Only a file that no
    longer matches that record (corrupt in the cache) is moved aside to
    ``rejected/`` next to it, so that the next run downloads it again.
    """
    actual = sha256_file(path)
    if actual == pinned:
        return
    record = path.with_name(path.name + DOWNLOAD_RECORD)
    recorded = record.read_text().split()[0] if record.is_file() else None
    if recorded is not None and recorded != actual:
        rejected = path.parent / "rejected"
        rejected.mkdir(parents=True, exist_ok=True)
        kept = rejected / f"{path.name}.{actual[:12]}.{int(time.time())}"
        shutil.move(path, kept)
        record.unlink()
        raise HmastackError(
            f"{path} is corrupt: its sha256 {actual} is not the {recorded} recorded "
            f"when it was downloaded. It was moved aside to {kept}.",
            "rerun to download it again",
        )
    state = "as downloaded" if recorded else "no download record"
    raise HmastackError(
        f"checksum mismatch for {path.name}: {pinned_in} pins sha256 {pinned}, the "
        f"cached {path} has {actual} ({state}). It is not used in this run and "
        "stays in the cache, which every clone on this machine shares.",
        hint,
    )


def update_with_tree(digest: hashlib._Hash, root: Path) -> None:
    """Feed every file below ``root`` into ``digest`` (a hashlib object), in
    sorted order: its path relative to ``root``, then its bytes. What installing
    a package writes into its own folder (``__pycache__``, ``build``,
    ``*.egg-info``) is not an input and is left out."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        written = any(
            p in ("__pycache__", "build") or p.endswith(".egg-info") for p in rel.parts
        )
        if path.is_file() and not written:
            digest.update(str(rel).encode())
            digest.update(path.read_bytes())


@dataclass(frozen=True)
class Env:
    root: Path
    hf_home: Path
    # support/testkit, put after ``pythonpath`` in test_environ (None: not)
    testkit: Path | None = None

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def pip(self) -> list[str]:
        return [str(self.python), "-m", "pip"]

    def test_environ(self, pythonpath: list[Path]) -> dict[str, str]:
        """Variables under which vLLM's tests run offline on the CPU;
        ``PYTHONPATH`` is ``pythonpath`` and then the testkit."""
        paths = [*pythonpath, *([self.testkit] if self.testkit else [])]
        return {
            "PYTHONPATH": os.pathsep.join(str(p) for p in paths),
            "HF_HOME": str(self.hf_home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }


def location(cfg: Config) -> Env:
    return Env(
        root=cfg.build / "env",
        hf_home=cfg.build / "hf-home",
        testkit=cfg.root / TESTKIT,
    )


def _pip_environ(cfg: Config) -> dict[str, str]:
    return {
        "PIP_CACHE_DIR": str(cfg.cache / "pip"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
    }


def _pip(cfg: Config, env: Env, *args: str, what: str) -> None:
    try:
        run(
            [*env.pip, "install", "--progress-bar", "off", *args],
            env=_pip_environ(cfg),
            log=cfg.build / "logs" / "env-pip.log",
        )
    except CommandError as exc:
        raise HmastackError(
            f"installing {what} into {env.root} failed:\n{exc.message}",
            "pip needs the package index (PyPI) unless every wheel is in its cache "
            f"({cfg.cache / 'pip'}); check the network, then rerun `hmastack env`",
        ) from exc


def _key(cfg: Config) -> str:
    digest = hashlib.sha256()
    digest.update(f"torch={cfg.env.torch};no_deps={cfg.env.no_deps};".encode())
    digest.update(sys.version.encode())
    digest.update(cfg.lock.read_bytes())
    if cfg.connectors_lock is not None:
        digest.update(cfg.connectors_lock.read_bytes())
    digest.update((cfg.root / HF_MODELS).read_bytes())
    update_with_tree(digest, cfg.plugin)
    return digest.hexdigest()


def bootstrap(cfg: Config) -> Env:
    """A virtualenv with torch and the build tools that ``pip download`` of vLLM's
    source release needs (it prepares metadata with ``--no-build-isolation``)."""
    env = location(cfg)
    marker = env.root / ".hmastack-bootstrap"
    want = f"torch=={cfg.env.torch}"
    if marker.exists() and marker.read_text() == want:
        return env
    with step(f"create {env.root} with torch {cfg.env.torch} (CPU)"):
        if env.root.exists():
            shutil.rmtree(env.root)
        run([sys.executable, "-m", "venv", env.root])
        # torch first and alone, so no later resolver can swap in a CUDA build.
        _pip(
            cfg,
            env,
            f"torch=={cfg.env.torch}",
            *BOOTSTRAP,
            what=f"torch {cfg.env.torch}",
        )
        probe = "import torch; print(torch.__version__, torch.version.cuda)"
        version, cuda = run([env.python, "-c", probe]).stdout.split()[-2:]
        if not version.startswith(cfg.env.torch) or cuda != "None":
            raise HmastackError(
                f"torch in {env.root} is {version} (CUDA {cuda}); expected the CPU "
                f"build of {cfg.env.torch}",
                "pip took a CUDA build: put the CPU wheel "
                f"(torch-{cfg.env.torch}+cpu) where pip finds it (a --find-links "
                "directory in pip's configuration), remove build/env and rerun",
            )
        marker.write_text(want)
    return env


def ensure(cfg: Config) -> Env:
    """The full test environment, rebuilt only when its inputs changed."""
    env = bootstrap(cfg)
    key_file = env.root / ".hmastack-env-key"
    key = _key(cfg)
    if key_file.exists() and key_file.read_text() == key and env.hf_home.exists():
        return env
    if not cfg.lock.exists():
        raise HmastackError(f"the dependency lock {cfg.lock} is missing")
    with step(f"install vLLM's locked dependencies ({cfg.lock.name})"):
        _pip(cfg, env, "--no-deps", "-r", str(cfg.lock), what="the locked dependencies")
    if cfg.env.no_deps:
        with step(f"install {', '.join(cfg.env.no_deps)} without dependencies"):
            _pip(
                cfg, env, "--no-deps", *cfg.env.no_deps, what=", ".join(cfg.env.no_deps)
            )
    if cfg.connectors_lock is not None:
        lock = cfg.connectors_lock
        if not lock.exists():
            raise HmastackError(f"the dependency lock {lock} is missing")
        with step(f"install the KV connectors' test dependencies ({lock.name})"):
            # Every file is checked against its sha256 in the lock; pip keeps the
            # wheels in the per-user cache, so a fresh clone finds them again.
            _pip(
                cfg,
                env,
                "--no-deps",
                "--require-hashes",
                "-r",
                str(lock),
                what=f"the hashed pins of {lock.name}",
            )
    with step("install the test-support plugin (CpuPlatform)"):
        _pip(
            cfg,
            env,
            "--no-deps",
            "--no-build-isolation",
            "--force-reinstall",
            str(cfg.plugin),
            what="the test-support plugin",
        )
    with step(f"write the offline Hugging Face cache {env.hf_home}"):
        if env.hf_home.exists():
            shutil.rmtree(env.hf_home)
        run(
            [
                env.python,
                "-m",
                "hmastack_vllm_cpu.hfcache",
                cfg.root / HF_MODELS,
                env.hf_home,
            ]
        )
    key_file.write_text(key)
    return env


def run_step(cfg: Config) -> StepResult:
    """``hmastack env``: build/env and the offline HF cache, made when missing."""
    env = ensure(cfg)
    console.print(f"environment: {env.root}")
    console.print(f"offline HF cache: {env.hf_home}")
    return StepResult(True, str(env.root))


def ruff(cfg: Config, version: str) -> Path:
    """The ``ruff`` binary of ``version``, installed once under build/env/tools/.

    Each tree is checked with the ruff its own pre-commit configuration pins.
    """
    env = bootstrap(cfg)
    target = env.root / "tools" / f"ruff-{version}"
    binary = target / "bin" / "ruff"
    if not binary.exists():
        with step(f"install ruff {version}"):
            _pip(cfg, env, "--target", str(target), f"ruff=={version}", what="ruff")
    return binary
