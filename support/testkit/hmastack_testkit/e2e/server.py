"""Server smoke test: ``vllm serve`` with the test connector, the ``openai`` client.

The server runs the tiny model on 127.0.0.1 (a free port) with the stage's
test connector and without a local prefix cache, so a repeated prompt can only
be served from the connector. The same completion is sent twice; the second
must report the connector's tokens as cached (``usage.prompt_tokens_details``)
and return the same tokens. The server is started and stopped here (process
group killed on the way out, also on errors and time-outs).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

START_TIMEOUT = 240.0
# ``_free_port`` closes the port it found; ``vllm serve`` binds it seconds
# later, after its imports. Another process (the other engine of ``--jobs 2``)
# may take it in between: the server then exits with this error, and starts
# again on a new port.
PORT_TAKEN = "Address already in use"
ATTEMPTS = 3
LOG_TAIL_LINES = 40


class ServerExited(RuntimeError):
    """``vllm serve`` ended before it answered ``/health``."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(plan, port: int, config: dict, *, prefix_caching: bool) -> list[str]:
    """``vllm serve`` of the tiny model on 127.0.0.1 with the KV transfer
    ``config``, HMA on or off as the plan's stage has it."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(plan.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        "16",
        "--max-model-len",
        "4096",
        *([] if prefix_caching else ["--no-enable-prefix-caching"]),
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(config),
        "--no-disable-hybrid-kv-cache-manager"
        if plan.hma
        else "--disable-hybrid-kv-cache-manager",
    ]


def _complete(client, prompt: list[int], key: str, expected_cached: int) -> dict:
    """One completion of ``prompt`` (8 tokens, greedy) through the ``openai``
    client; a ``RequestRecord``-shaped dict."""
    resp = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        extra_body={"return_token_ids": True, "min_tokens": 8},
    )
    choice = resp.choices[0]
    details = resp.usage.prompt_tokens_details
    return {
        "key": key,
        "prompt_len": len(prompt),
        "tokens": list(choice.token_ids or []),
        "logprobs": [],
        # vLLM leaves prompt_tokens_details out when nothing was cached
        "num_cached_tokens": (details.cached_tokens or 0) if details else 0,
        "expected_cached": expected_cached,
        "kv_transfer_params": None,
        # the server returns logprobs as token strings, and runs without a
        # tokenizer here: tokens only
        "tokens_only": True,
    }


def run(plan, prompt: list[int], log: Path) -> list[dict]:
    """Two completions of ``prompt`` through the server; returns two
    ``RequestRecord``-shaped dicts (``first``, ``second``)."""
    import openai

    config = {
        "kv_connector": "CPUTestHMAConnector"
        if plan.connector == "hma"
        else "CPUTestConnector",
        "kv_connector_module_path": "hmastack_testkit.e2e.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_dir": str(plan.store_dir)},
    }

    def start() -> tuple[subprocess.Popen, int]:
        port = _free_port()
        # subprocess directly: the engine environment has no hmastack (whose
        # core.process runs every command of the tool itself)
        with log.open("w") as out:
            server = subprocess.Popen(
                _serve_cmd(plan, port, config, prefix_caching=False),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=os.environ.copy(),
            )
        return server, port

    ((server, port),) = _start_up([(start, log)], time.monotonic() + START_TIMEOUT)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120
        )
        records = [
            _complete(client, prompt, key, expected)
            for key, expected in (("first", 0), ("second", len(prompt) // 16 * 16))
        ]
        return records
    finally:
        _stop(server)


# --- P/D with NixlConnector: two servers and a proxy --------------------------------


def _nixl_server(plan, log: Path) -> tuple[subprocess.Popen, int]:
    """``vllm serve`` with NixlConnector (kv_both) on 127.0.0.1 (a free port);
    its NIXL side channel and UCX on the loopback interface too."""
    port, side_channel_port = _free_port(), _free_port()
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
    }
    cmd = _serve_cmd(plan, port, config, prefix_caching=True)
    env = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
    }
    with log.open("w") as out:
        server = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    return server, port


def _log_tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _start_up(
    starts: list[tuple[Callable[[], tuple[subprocess.Popen, int]], Path]],
    deadline: float,
) -> list[tuple[subprocess.Popen, int]]:
    """Start every server (``start`` picks its ports and writes ``log``) at
    once and wait until each answers ``/health``. A server that exits because
    its port was taken before it bound it starts again on new ports, up to
    ``ATTEMPTS`` times; any other exit stops them all and raises
    ``ServerExited`` with the end of its log."""
    running = [start() for start, _ in starts]
    try:
        for i, (start, log) in enumerate(starts):
            for attempt in range(1, ATTEMPTS + 1):
                server, port = running[i]
                try:
                    _wait_up(server, port, deadline, log)
                    break
                except ServerExited:
                    taken = PORT_TAKEN in _log_tail(log)
                    if not taken or attempt == ATTEMPTS:
                        raise
                    print(
                        f"vllm serve: a port was taken before it bound it "
                        f"({log.name}); starting it again on new ports",
                        file=sys.stderr,
                    )
                    _stop(server)
                    running[i] = start()
    except BaseException:
        for server, _ in running:
            _stop(server)
        raise
    return running


def _wait_up(server, port: int, deadline: float, log: Path) -> None:
    import requests

    while True:
        if server.poll() is not None:
            raise ServerExited(
                f"vllm serve exited with {server.returncode} before it was up; "
                f"the end of {log}:\n{_log_tail(log)}"
            )
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"vllm serve not up after {START_TIMEOUT} s; the end of {log}:\n"
                + _log_tail(log)
            )
        time.sleep(1)


def _stop(server) -> None:
    """Stop the server's process group (its engine core too)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:  # the group has ended already
        server.wait()
        return
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _proxy(prefill_port: int, decode_port: int):
    """A proxy as in vLLM's P/D examples, on 127.0.0.1: a completion goes to
    the prefill server with ``max_tokens=1`` and ``do_remote_decode``, then
    to the decode server with the ``kv_transfer_params`` the prefill server
    returned; the client gets the decode server's answer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import requests

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prefill = {
                **body,
                "max_tokens": 1,
                "min_tokens": 0,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            first = requests.post(
                f"http://127.0.0.1:{prefill_port}{self.path}", json=prefill, timeout=120
            )
            first.raise_for_status()
            params = first.json().get("kv_transfer_params")
            decode = {**body, "kv_transfer_params": params}
            answer = requests.post(
                f"http://127.0.0.1:{decode_port}{self.path}", json=decode, timeout=120
            )
            data = answer.content
            self.send_response(answer.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def run_pd(plan, prompt: list[int], log: Path) -> list[dict]:
    """One completion of ``prompt`` through a proxy in front of a prefill and
    a decode ``vllm serve`` with NixlConnector; returns a
    ``RequestRecord``-shaped dict (``pd``) whose cached tokens are the ones
    the decode server received from the prefill server."""
    import openai

    servers = []
    httpd = None
    try:
        logs = [log.with_suffix(f".{i}.log") for i in range(2)]
        servers = _start_up(
            [(functools.partial(_nixl_server, plan, side), side) for side in logs],
            time.monotonic() + START_TIMEOUT,
        )
        httpd = _proxy(servers[0][1], servers[1][1])
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1",
            api_key="none",
            timeout=240,
        )
        # NixlConnector offers every prompt token but the last
        return [_complete(client, prompt, "pd", len(prompt) - 1)]
    finally:
        if httpd is not None:
            httpd.shutdown()
        for server, _ in servers:
            _stop(server)
