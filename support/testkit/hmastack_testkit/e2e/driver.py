"""Run one plan in one engine process and write what happened as JSON.

Usage: ``python -m hmastack_testkit.e2e.driver PLAN_JSON OUT_JSON``

The output holds, per scenario: its outcome (``ran``, ``stall``, ``error``), the
requests (generated tokens, top-k logprobs, ``num_cached_tokens``, the count
the scenario expects), what the engine showed (per-group block counts, running
requests, preemptions) and what the connector did (external hits, blocks loaded
and null blocks skipped per group, load failures, findings). The host
(``hmastack e2e``) compares runs; this process only reports.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path


def _connector_view(req_ids: set[str], seen_findings: int) -> tuple[dict, int]:
    from hmastack_testkit.e2e import connector

    view: dict = {
        "external_tokens": {},
        "loaded_blocks_per_group": {},
        "null_blocks_skipped_per_group": {},
        "failed_loads": {},
        "saved_blocks": 0,
        "findings": [],
    }
    findings = []
    for inst in list(connector.INSTANCES):
        st = inst.stats
        for name, src in (
            ("external_tokens", st.hits),
            ("loaded_blocks_per_group", st.load_blocks_per_group),
            ("null_blocks_skipped_per_group", st.null_blocks_skipped_per_group),
            ("failed_loads", st.failed_loads),
        ):
            for req_id, value in src.items():
                if req_id in req_ids:
                    view[name][req_id.split("#")[0]] = value
        view["saved_blocks"] += st.saved_blocks
        findings += st.findings
    view["findings"] = findings[seen_findings:]
    return view, len(findings)


def main(argv: list[str]) -> int:
    plan_path, out_path = Path(argv[0]), Path(argv[1])
    from hmastack_testkit.e2e.engine import Observation, Plan, Session, Stall
    from hmastack_testkit.e2e.scenarios import SCENARIOS

    plan = Plan.from_json(json.loads(plan_path.read_text()))
    result: dict = {
        "plan": json.loads(plan_path.read_text()),
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        "scenarios": {},
    }
    start = time.monotonic()
    if plan.connector in ("plain", "hma") and plan.scenarios == ["server-smoke"]:
        return _server(plan, result, out_path, start)
    if plan.connector == "nixl" and plan.scenarios == ["server-pd-nixl"]:
        return _server_pd(plan, result, out_path, start)
    try:
        if plan.connector == "lmcache":
            from hmastack_testkit.e2e import lmcache_cpu

            lmcache_cpu.install()
        session = Session(plan)
    except Exception:
        result["error"] = traceback.format_exc()
        out_path.write_text(json.dumps(result, indent=1))
        print(result["error"], file=sys.stderr)
        return 3
    result["init_seconds"] = round(session.init_seconds, 2)
    result["groups"] = session.group_kinds()
    result["num_blocks"] = session.num_free_blocks()
    seen = 0
    stalled = False
    for name in plan.scenarios:
        entry: dict = {"outcome": "ran"}
        t0 = time.monotonic()
        if stalled:
            entry["outcome"] = "not run"
            entry["detail"] = "the engine stalled in an earlier scenario"
            result["scenarios"][name] = entry
            continue
        obs = Observation()
        first_id = session._next_id
        # Scenarios are independent: their own store folder, no local hits left.
        session.namespace = plan.namespace or name
        try:
            session.reset_prefix_cache()
            records = SCENARIOS[name](session, plan.connector is not None, obs)
            entry["requests"] = [asdict(r) for r in records]
        except Stall as exc:
            entry["outcome"] = "stall"
            entry["detail"] = str(exc)
            stalled = True
        except Exception:
            entry["outcome"] = "error"
            entry["detail"] = traceback.format_exc()
        entry["observation"] = asdict(obs)
        req_ids = {r for r in session.scheduler.requests} | _ids_since(
            session, first_id
        )
        if plan.connector in ("plain", "hma"):
            entry["connector"], seen = _connector_view(req_ids, seen)
        elif plan.connector == "lmcache":
            from hmastack_testkit.e2e import lmcache_cpu

            entry["connector"] = {"lmcache_copies": dict(lmcache_cpu.COPIES)}
        elif plan.connector == "nixl":
            from hmastack_testkit.e2e import nixl_observe

            entry["connector"] = nixl_observe.view(first_id)
        elif plan.connector == "offload":
            from hmastack_testkit.e2e import offload_observe

            entry["connector"], seen = offload_observe.view(first_id, seen)
        entry["seconds"] = round(time.monotonic() - t0, 2)
        result["scenarios"][name] = entry
        out_path.write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.monotonic() - start, 2)
    out_path.write_text(json.dumps(result, indent=1))
    if plan.connector == "lmcache":
        from hmastack_testkit.e2e import lmcache_cpu

        lmcache_cpu.shutdown()
    # A stalled engine holds requests that never finish: leave without waiting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _server(plan, result: dict, out_path: Path, start: float) -> int:
    """The server smoke test: ``vllm serve`` in a child process."""
    from hmastack_testkit.e2e import server
    from hmastack_testkit.e2e.scenarios import PREFIX, SERVER_PROMPT, _p, _prefix

    entry: dict = {"outcome": "ran", "observation": {}}
    prompt = _prefix() + _p(201, SERVER_PROMPT - PREFIX)
    try:
        entry["requests"] = server.run(
            plan, prompt, out_path.with_suffix(".server.log")
        )
    except Exception:
        entry["outcome"] = "error"
        entry["detail"] = traceback.format_exc()
    entry["seconds"] = round(time.monotonic() - start, 2)
    result["scenarios"]["server-smoke"] = entry
    result["groups"] = []
    out_path.write_text(json.dumps(result, indent=1))
    return 0


def _server_pd(plan, result: dict, out_path: Path, start: float) -> int:
    """The P/D server pair: two ``vllm serve`` and a proxy, in child processes."""
    from hmastack_testkit.e2e import server
    from hmastack_testkit.e2e.scenarios import _nixl_prompt

    entry: dict = {"outcome": "ran", "observation": {}}
    try:
        entry["requests"] = server.run_pd(
            plan, _nixl_prompt(), out_path.with_suffix(".server.log")
        )
    except Exception:
        entry["outcome"] = "error"
        entry["detail"] = traceback.format_exc()
    entry["seconds"] = round(time.monotonic() - start, 2)
    result["scenarios"]["server-pd-nixl"] = entry
    result["groups"] = []
    out_path.write_text(json.dumps(result, indent=1))
    return 0


def _ids_since(session, first_id: int) -> set[str]:
    """Request ids the session made since ``first_id`` (``key#n``)."""
    from hmastack_testkit.e2e import connector

    ids = set()
    for inst in list(connector.INSTANCES):
        for req_id in inst.stats.hits:
            if int(req_id.rsplit("#", 1)[1]) >= first_id:
                ids.add(req_id)
    return ids


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
