"""Server smoke test: ``vllm serve`` with the test connector, the ``openai`` client.

The server runs the tiny model on 127.0.0.1 (a free port) with the stage's
test connector and without a local prefix cache, so a repeated prompt can only
be served from the connector. The same completion is sent twice; the second
must report the connector's tokens as cached (``usage.prompt_tokens_details``)
and return the same tokens. The server is started and stopped here (process
group killed on the way out, also on errors and time-outs).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(plan, prompt: list[int], log: Path) -> list[dict]:
    """Two completions of ``prompt`` through the server; returns two
    ``RequestRecord``-shaped dicts (``first``, ``second``)."""
    import openai
    import requests

    port = _free_port()
    config = {
        "kv_connector": "CPUTestHMAConnector"
        if plan.connector == "hma"
        else "CPUTestConnector",
        "kv_connector_module_path": "hmastack_e2e.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_dir": str(plan.store_dir)},
    }
    cmd = [
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
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(config),
        "--no-disable-hybrid-kv-cache-manager"
        if plan.hma
        else "--disable-hybrid-kv-cache-manager",
    ]
    with log.open("w") as out:
        server = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=os.environ.copy(),
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {server.returncode}")
                try:
                    if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve not up after {START_TIMEOUT} s")
                time.sleep(1)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120
            )
            records = []
            for key, expected in (("first", 0), ("second", len(prompt) // 16 * 16)):
                resp = client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=8,
                    temperature=0.0,
                    extra_body={"return_token_ids": True, "min_tokens": 8},
                )
                choice = resp.choices[0]
                details = resp.usage.prompt_tokens_details
                records.append(
                    {
                        "key": key,
                        "prompt_len": len(prompt),
                        "tokens": list(choice.token_ids or []),
                        "logprobs": [],
                        # vLLM leaves prompt_tokens_details out when nothing
                        # was cached
                        "num_cached_tokens": (details.cached_tokens or 0)
                        if details
                        else 0,
                        "expected_cached": expected,
                        "kv_transfer_params": None,
                        # the server returns logprobs as token strings, and
                        # runs without a tokenizer here: tokens only
                        "tokens_only": True,
                    }
                )
            return records
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
