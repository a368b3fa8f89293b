"""How the scheduler-cost scenario measures a step: CPU time, instructions, bytecodes.

Every meter is used the same way by ``scheduler_cost.py``::

    meter.begin(label)            # before the measured steps of one setting
    out = meter.call(fn, *args)   # around schedule() and update_from_output() only
    row |= meter.end(label)       # after them: the figures of this setting

so the three measures are taken of the same calls. The garbage collector is off
between ``begin`` and ``end`` in all three (``gc.collect()`` first): a collection
is triggered by allocation counts accumulated since the process started, which
differ between trees for reasons outside the scheduler (their imports).

* :class:`CpuTime`: ``time.process_time`` summed over the calls. Noisy on a
  shared machine.
* :class:`Instructions`: the process runs under valgrind's callgrind with
  ``--instr-atstart=no --collect-atstart=no --toggle-collect=<marker>``.
  ``begin`` switches instrumentation on (``vgdb instrumentation on``), ``call``
  runs ``fn`` inside the marker, a C function that callgrind toggles collection on
  entering and off leaving, so exactly the instructions executed inside ``fn``
  are counted; ``end`` writes them to a dump file (``vgdb dump <label>``) and
  switches instrumentation off again, so imports and set-up run at valgrind's
  uninstrumented speed and are never counted. The marker is ``sys_call_tracing``,
  the C function behind ``sys.call_tracing(fn, args)`` (which calls ``fn`` with
  the interpreter's tracing state saved and restored: a no-op when no tracer is
  set), or, for an interpreter without that symbol (a stripped build), glibc's
  ``qsort_r``, entered through ``qsort`` sorting two elements with a ctypes
  comparison callback that runs ``fn``.
* :class:`Bytecodes`: ``sys.settrace`` with opcode events counts, per Python
  function, the bytecode instructions it executes itself and inclusive of its
  callees, and how often it is called; ``sys.setprofile`` counts the calls of
  C functions (builtins) per name. Deterministic; names Python functions, which
  callgrind cannot (it sees only the interpreter's C functions).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import time


class Meter:
    name = "none"

    def begin(self, label: str) -> None:
        self.calls = 0
        gc.collect()
        gc.disable()

    def call(self, fn, *args):
        return fn(*args)

    def end(self, label: str) -> dict:
        gc.enable()
        return {"meter_calls": self.calls}


class CpuTime(Meter):
    name = "cpu"

    def begin(self, label: str) -> None:
        self.total = 0.0
        super().begin(label)

    def call(self, fn, *args):
        self.calls += 1
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            self.total += time.process_time() - t0

    def end(self, label: str) -> dict:
        return {**super().end(label), "cpu_s": self.total}


class VgdbError(RuntimeError):
    pass


class Instructions(Meter):
    """Counted by callgrind; see the module docstring. ``vgdb``: the path of
    valgrind's vgdb; ``entry``: how a measured call enters the marker,
    ``sys.call_tracing`` or ``qsort``."""

    name = "instructions"

    def __init__(self, vgdb: str, entry: str):
        self.vgdb = vgdb
        self.entry = entry
        if entry == "qsort":
            self._qsort = _QsortMarker()
        elif entry != "sys.call_tracing":
            raise ValueError(f"unknown marker entry {entry!r}")

    def _monitor(self, *command: str) -> str:
        """Send a callgrind monitor command to this process through vgdb.

        This process waits blocked in ``waitpid``; vgdb reaches valgrind's
        gdbserver through ptrace then. The wait allocates the same Python
        objects every time: a loop whose number of turns depends on timing (a
        spin until vgdb ends, or ``communicate`` with a timeout) would leave the
        memory allocator in a varying state, and that shows in the counts of
        the measured calls that follow."""
        # subprocess directly: build/env has no hmastack (whose core.process
        # runs every command of the tool itself)
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                [self.vgdb, f"--pid={os.getpid()}", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            code = proc.wait()
            out.seek(0)
            text = out.read().decode(errors="replace")
        if code != 0 or "error" in text.lower():
            raise VgdbError(
                f"vgdb {' '.join(command)} failed ({code}): {text.strip()} (is this "
                "process running under valgrind --tool=callgrind, and may vgdb "
                "ptrace it?)"
            )
        return text

    def begin(self, label: str) -> None:
        super().begin(label)
        self._monitor("instrumentation", "on")

    def call(self, fn, *args):
        self.calls += 1
        if self.entry == "qsort":
            return self._qsort.call(fn, args)
        return sys.call_tracing(fn, args)

    def end(self, label: str) -> dict:
        self._monitor("dump", label)
        self._monitor("instrumentation", "off")
        return {**super().end(label), "dump": label}


class _QsortMarker:
    """Runs ``fn`` inside libc's ``qsort`` (two elements, one comparison)."""

    def __init__(self):
        import ctypes

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None)
        self._libc.qsort.restype = None
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        self._cmp = proto(self._compare)  # built once, outside the counted calls
        self._array = (ctypes.c_int * 2)()
        self._job = None
        self._result = None

    def _compare(self, _a, _b) -> int:
        fn, args = self._job
        try:
            self._result = (True, fn(*args))
        except BaseException as exc:  # re-raised outside the C callback
            self._result = (False, exc)
        return 0

    def call(self, fn, args):
        self._job, self._result = (fn, args), None
        self._libc.qsort(
            self._array, 2, self._ctypes.sizeof(self._ctypes.c_int), self._cmp
        )
        if self._result is None:
            raise RuntimeError("qsort did not call the comparison")
        ok, value = self._result
        if not ok:
            raise value
        return value


class Bytecodes(Meter):
    """Per Python function (``file:qualname``, the file relative to ``root``):
    calls, bytecodes executed by the function itself (``self``) and inclusive of
    everything it calls (``incl``, counted once per outermost activation); per C
    function: calls."""

    name = "bytecodes"

    def __init__(self, root: str):
        self.root = os.path.realpath(root) + os.sep
        self._names: dict = {}

    def begin(self, label: str) -> None:
        self.funcs: dict[str, list[int]] = {}  # name -> [calls, self, incl]
        self.cfuncs: dict[str, int] = {}
        self._stack: list[list] = []  # [name, bytecodes so far incl.]
        self._active: dict[str, int] = {}
        super().begin(label)

    def _name(self, code) -> str:
        name = self._names.get(code)
        if name is None:
            path = os.path.realpath(code.co_filename)
            if path.startswith(self.root):
                path = path[len(self.root) :]
            elif "site-packages" + os.sep in path:
                path = path.split("site-packages" + os.sep, 1)[1]
            name = self._names[code] = f"{path}:{code.co_qualname}"
        return name

    def _trace(self, frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
            name = self._name(frame.f_code)
            entry = self.funcs.setdefault(name, [0, 0, 0])
            entry[0] += 1
            self._stack.append([name, 0])
            self._active[name] = self._active.get(name, 0) + 1
            return self._trace
        if event == "opcode":
            top = self._stack[-1]
            top[1] += 1
            self.funcs[top[0]][1] += 1
        elif event == "return":
            name, incl = self._stack.pop()
            self._active[name] -= 1
            if self._active[name] == 0:
                self.funcs[name][2] += incl
            if self._stack:
                self._stack[-1][1] += incl
        return self._trace

    def _profile(self, frame, event, arg):
        if event == "c_call":
            mod = (
                getattr(arg, "__module__", None)
                or type(getattr(arg, "__self__", None)).__name__
            )
            key = f"{mod}.{arg.__qualname__}"
            self.cfuncs[key] = self.cfuncs.get(key, 0) + 1

    def call(self, fn, *args):
        self.calls += 1
        sys.setprofile(self._profile)
        sys.settrace(self._trace)
        try:
            return fn(*args)
        finally:
            sys.settrace(None)
            sys.setprofile(None)

    def end(self, label: str) -> dict:
        total = sum(v[1] for v in self.funcs.values())
        return {
            **super().end(label),
            "bytecodes": total,
            "functions": {
                k: {"calls": v[0], "self": v[1], "incl": v[2]}
                for k, v in self.funcs.items()
            },
            "c_calls": dict(self.cfuncs),
        }


def make(spec: dict) -> Meter:
    """The meter a scenario's arguments ask for (``{"meter": "cpu", ...}``)."""
    kind = spec.get("meter", "cpu")
    if kind == "cpu":
        return CpuTime()
    if kind == "instructions":
        return Instructions(spec["vgdb"], spec.get("entry", "sys.call_tracing"))
    if kind == "bytecodes":
        return Bytecodes(spec.get("root", os.getcwd()))
    raise ValueError(f"unknown meter {kind!r}")
