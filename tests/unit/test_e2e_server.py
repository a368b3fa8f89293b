"""The e2e server harness starts ``vllm serve`` again when its port was taken
before it bound it, and says why a server that exits for any other reason
did (hmastack_testkit.e2e.server). Small Python servers stand in for
``vllm serve``: what is tested is the harness, not the engine."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hmastack_testkit.e2e import server

# Binds 127.0.0.1:<port> and answers /health, as vllm serve does; Python's
# own error names the taken port ("Address already in use").
STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _starter(log: Path, ports: list[int]):
    """A ``start`` that serves on the next of ``ports`` (a new free one when
    they run out), as the harness's starts pick their ports."""
    started = []

    def start() -> tuple[subprocess.Popen, int]:
        port = ports.pop(0) if ports else server._free_port()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", STAND_IN, str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(port)
        return proc, port

    return start, started


def _exiting(log: Path, code: str) -> subprocess.Popen:
    """A stand-in that ends at once with ``raise SystemExit(code)``."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", f"raise SystemExit({code})"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop_all(running):
    for proc, _ in running:
        server._stop(proc)


def test_a_server_whose_port_was_taken_starts_again_on_a_new_port(tmp_path):
    log = tmp_path / "serve.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start, started = _starter(log, [taken.getsockname()[1]])
        running = server._start_up([(start, log)], time.monotonic() + 60)
        try:
            ((_, port),) = running
            assert started == [taken.getsockname()[1], port]
            assert port != taken.getsockname()[1]
        finally:
            _stop_all(running)


def test_a_taken_port_every_time_gives_up_with_the_log(tmp_path, monkeypatch):
    log = tmp_path / "serve.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(server, "_free_port", lambda: port)
        start, started = _starter(log, [])
        with pytest.raises(server.ServerExited, match=server.PORT_TAKEN):
            server._start_up([(start, log)], time.monotonic() + 60)
        assert started == [port] * server.ATTEMPTS


def test_a_server_that_exits_for_another_reason_is_not_started_again(tmp_path):
    log = tmp_path / "serve.log"
    started = []

    def start():
        started.append(_exiting(log, "'no model here'"))
        return started[-1], server._free_port()

    with pytest.raises(server.ServerExited) as caught:
        server._start_up([(start, log)], time.monotonic() + 60)
    assert len(started) == 1
    assert "exited with 1" in str(caught.value)
    assert "no model here" in str(caught.value)  # the end of its log


def test_when_one_server_fails_the_others_are_stopped(tmp_path):
    good_log, bad_log = tmp_path / "good.log", tmp_path / "bad.log"
    good, _ = _starter(good_log, [])
    running = []

    def start_good():
        proc, port = good()
        running.append(proc)
        return proc, port

    def start_bad():
        return _exiting(bad_log, "3"), server._free_port()

    with pytest.raises(server.ServerExited, match="exited with 3"):
        server._start_up(
            [(start_good, good_log), (start_bad, bad_log)], time.monotonic() + 60
        )
    assert [proc.poll() is not None for proc in running] == [True]
