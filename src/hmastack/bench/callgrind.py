"""Instruction counts with valgrind's callgrind: the command line, the marker
probe and the reading of callgrind's output files.

How a region of a Python program is counted (``bench/scenarios/_meters.py`` is
the other half): the program runs under ::

    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \\
             --toggle-collect=<marker> ...

Nothing is instrumented at start (imports run at valgrind's uninstrumented
speed) and nothing is collected. The program switches instrumentation on and off
around its measured part with vgdb monitor commands, and runs each measured
call inside the *marker*, a C function on whose entry callgrind switches
collection on and on whose exit off again: ``sys_call_tracing`` (behind
``sys.call_tracing(fn, args)``) or, where the interpreter has no symbol table,
glibc's ``qsort_r`` (entered through ``qsort`` with a ctypes callback).
``vgdb dump <label>`` then writes the instructions collected since the last
dump to a file whose ``desc: Trigger:`` line carries the label.
:func:`probe_marker` picks the marker that works with a given interpreter.

Reading a dump (:func:`read_dump`): the total is the sum of the *self* cost
lines. callgrind's own ``summary:`` line is wrong in dumps taken while
collection is toggled (it goes negative, printed as a huge unsigned number), and
``callgrind_annotate``'s ``PROGRAM TOTALS`` repeats it; the self costs are the
primary data and sum to the real count (the first dump of a run, where
``summary:`` is right, agrees exactly: see ``tests/unit/test_bench_counts.py``).
Call edges to the marker inside a dump mean it was entered while collecting
(nested): the count would be cut short, so :func:`read_dump` reports them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack.core.errors import HmastackError
from hmastack.core.process import run

# (how Python enters the marker, the C function callgrind toggles on): tried in
# this order. glibc's qsort runs its work in qsort_r (as callgrind names it when
# instrumentation starts late); plain qsort for a glibc where it does not.
MARKERS = (
    ("sys.call_tracing", "sys_call_tracing"),
    ("qsort", "qsort_r"),
    ("qsort", "qsort"),
)

# One measured call through the real meter, as a scenario makes it.
_PROBE = """
import sys
sys.path.insert(0, {scenarios!r})
import _meters
meter = _meters.Instructions({vgdb!r}, {entry!r})
meter.begin("probe")
meter.call(sum, [1, 2, 3])
print(meter.end("probe"))
"""


@dataclass(frozen=True)
class Callgrind:
    """Where valgrind and vgdb are, and the marker this interpreter supports:
    ``entry``, how the meter enters it (``sys.call_tracing`` or ``qsort``), and
    ``marker``, the C function whose entry and exit toggle collection."""

    valgrind: str
    vgdb: str
    entry: str
    marker: str

    def command(self, out_dir: Path, trace_children: bool = False) -> list[str]:
        """valgrind's arguments (before the program). Dumps go to
        ``out_dir/cg.<pid>.<n>``; with ``trace_children`` a forked child keeps a
        gdbserver of its own (so vgdb reaches it) while every program a process
        executes (vgdb itself, ``uname`` run by a module) runs natively."""
        cmd = [
            self.valgrind,
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--toggle-collect={self.marker}",
            "--dump-line=no",
            "--dump-instr=no",
            f"--callgrind-out-file={out_dir / 'cg.%p'}",
            f"--log-file={out_dir / 'valgrind.%p.log'}",
        ]
        if trace_children:
            # Forked children keep a gdbserver only with --trace-children=yes;
            # "skip *" runs every program they execute (vgdb, uname) natively.
            cmd += ["--trace-children=yes", "--trace-children-skip=*"]
        return cmd


def hardware_counters() -> str:
    """Whether this machine exposes the CPU's instruction counter to ``perf``
    (the faster alternative to callgrind): ``perf stat -x, -e instructions true``
    prints a count, or ``<not supported>`` (as in this virtual machine)."""
    perf = shutil.which("perf")
    if perf is None:
        return "perf is not installed"
    proc = run([perf, "stat", "-x,", "-e", "instructions", "true"], check=False)
    first = (proc.stdout.strip().splitlines() or [""])[0]
    value = first.split(",")[0]
    if proc.returncode == 0 and value.isdigit():
        return f"supported ({value} instructions for `true`)"
    return (
        f"not supported (`perf stat -e instructions true`: {first or proc.returncode})"
    )


def locate() -> tuple[str, str]:
    """The paths of ``valgrind`` and ``vgdb``; :class:`HmastackError` if missing."""
    valgrind, vgdb = shutil.which("valgrind"), shutil.which("vgdb")
    if not valgrind or not vgdb:
        raise HmastackError(
            "valgrind (with vgdb) is not installed: instruction counts need it",
            "install Debian's valgrind package (apt-get install valgrind), or run "
            "`hmastack bench` with --no-instructions",
        )
    return valgrind, vgdb


def probe_marker(
    python: Path, scenarios: Path, env: dict[str, str] | None = None
) -> Callgrind:
    """The first marker of :data:`MARKERS` with which callgrind counts one
    measured call of the real meter (``scenarios/_meters.py``) exactly once, in
    this interpreter under the conditions of a run (instrumentation switched on
    late). A stripped interpreter has no ``sys_call_tracing`` symbol: nothing
    would be collected. Raises :class:`HmastackError` if no marker works."""
    valgrind, vgdb = locate()
    tried = []
    for entry, marker in MARKERS:
        with tempfile.TemporaryDirectory(prefix="hmastack-cg-") as tmp:
            out = Path(tmp)
            cg = Callgrind(valgrind, vgdb, entry, marker)
            code = _PROBE.format(scenarios=str(scenarios), vgdb=vgdb, entry=entry)
            proc = run(
                [*cg.command(out), python, "-S", "-c", code], env=env, check=False
            )
            pids = {p.name.split(".")[1] for p in out.glob("cg.*")}
            dump = None
            if proc.returncode == 0 and len(pids) == 1:
                dump = dumps_of(out, int(pids.pop()), marker).get("probe")
            if dump is not None and dump.total > 0 and dump.marker_calls == 1:
                return cg
            tried.append(
                f"{marker}: exit {proc.returncode}, "
                + (f"{dump.total} instructions" if dump else "no dump")
            )
    raise HmastackError(
        f"callgrind counts nothing inside any marker with {python} "
        f"({'; '.join(tried)})",
        "use an interpreter with its symbol table (e.g. a pyenv build, or install "
        "the python3.11-dbg symbols) and glibc's qsort",
    )


@dataclass
class Dump:
    """One callgrind dump: its label, the instructions it collected (sum of the
    self costs) and the self cost of each C function (recursion levels merged:
    ``f'2`` counts as ``f``), keyed ``function [object file name]``."""

    path: Path
    label: str
    pid: int | None
    total: int
    functions: dict[str, int] = field(default_factory=dict)
    marker_calls: int = 0  # calls of the marker recorded inside the dump


_NAME = re.compile(r"\((\d+)\)(?: (.*))?$")
_KINDS = {
    "fn": "fn",
    "cfn": "fn",
    "ob": "ob",
    "cob": "ob",
    "fl": "fl",
    "fi": "fl",
    "fe": "fl",
    "cfi": "fl",
    "cfl": "fl",
}


def read_dump(path: Path, marker: str | None = None) -> Dump:
    """Parse one callgrind output file (format version 1, as callgrind 3.x
    writes it: compressed names, ``positions: line``, one event ``Ir``)."""
    names: dict[tuple[str, str], str] = {}

    def name(kind: str, text: str) -> str:
        m = _NAME.match(text)
        if not m:
            return text
        key = (kind, m.group(1))
        if m.group(2) is not None:
            names[key] = m.group(2)
        return names.get(key, text)

    label, pid, total = "", None, 0
    functions: dict[str, int] = {}
    fn, ob, cfn = "", "", ""
    after_calls = False
    marker_calls = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line or line == "\n":
                continue
            head = line[0]
            if head.isdigit() or head in "+-*":
                if after_calls:  # the inclusive cost of a call, not self cost
                    after_calls = False
                    continue
                parts = line.split()
                if len(parts) > 1:
                    cost = int(parts[1])
                    total += cost
                    key = f"{fn.split(chr(39))[0]} [{Path(ob).name}]"
                    functions[key] = functions.get(key, 0) + cost
                continue
            key, sep, value = line.rstrip("\n").partition("=")
            if sep and key in _KINDS:
                resolved = name(_KINDS[key], value)
                if key == "fn":
                    fn = resolved
                elif key == "ob":
                    ob = resolved
                elif key == "cfn":
                    cfn = resolved
            elif sep and key == "calls":
                after_calls = True
                if marker and cfn.split("'")[0] == marker:
                    marker_calls += int(value.split()[0])
            elif line.startswith("desc: Trigger:"):
                label = line.split(":", 2)[2].strip()
                label = label.removeprefix("dump").strip()
            elif line.startswith("pid:"):
                pid = int(line.split(":", 1)[1])
    return Dump(Path(path), label, pid, total, functions, marker_calls)


def dumps_of(out_dir: Path, pid: int, marker: str | None = None) -> dict[str, Dump]:
    """The labelled dumps process ``pid`` wrote into ``out_dir``, by label (the
    file callgrind writes at program termination has none and is left out)."""
    out = {}
    for path in sorted(out_dir.glob(f"cg.{pid}.*")):
        dump = read_dump(path, marker)
        if dump.label and dump.label != "Program termination":
            out[dump.label] = dump
    return out


def diff_functions(
    base: dict[str, int], other: dict[str, int], top: int = 8
) -> list[dict]:
    """The functions whose self cost differs most between two profiles, largest
    absolute difference first: name, base, other, difference and its share of
    the total difference (the differences of all functions sum to it)."""
    delta_total = sum(other.values()) - sum(base.values())
    rows: list[dict[str, Any]] = []
    for key in set(base) | set(other):
        d = other.get(key, 0) - base.get(key, 0)
        if d:
            rows.append(
                {
                    "function": key,
                    "base": base.get(key, 0),
                    "other": other.get(key, 0),
                    "difference": d,
                    "share": round(d / delta_total, 3) if delta_total else None,
                }
            )
    rows.sort(key=lambda r: (-abs(r["difference"]), r["function"]))
    return rows[:top]
