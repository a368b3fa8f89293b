"""P/D with vLLM's NixlConnector under a KV budget on the decode side
(``hmastack bench --throughput``, scenario ``throughput_nixl``).

The setting of :mod:`hmastack.bench.throughput` with the KV coming from a
prefill engine instead of the CPU test connector: two engine processes at once
per run, as the end-to-end NIXL scenarios run them (``hmastack_testkit.e2e.throughput``
with ``role`` producer and consumer; NIXL over UCX and the side channel on
127.0.0.1). The producer prefills the batch (``max_tokens=1``,
``do_remote_decode``) in a pool that holds all of it and hands the
``kv_transfer_params`` over; the consumer (the decode side, measured) gets the
batch at once, reads every prompt token but the last with NIXL and decodes,
in a pool of :data:`CASES` blocks of one layer: the KV budget bounds the
decode side.

Layouts: the Gemma-3-like ``gemma-5to1`` (5 sliding-window layers, W=32, and
1 full-attention layer: 6 KV cache groups with HMA on) and the gpt-oss-like
``gemma-1to1`` (sliding window and full attention alternating, 6 layers: 2
groups of 3 layers). Trees (:func:`trees`): the base with HMA off (0.13.0's
NixlConnector does not support HMA), the first stage whose ``hma`` names
"nixl" with HMA on, and that stage with HMA forced off (the witness: the
series' code with the base's block layout; its memory-bound ratio stays near
1, so what moves the ratio is the layout that stage allows).

Block counts' prediction: per KV cache group of the consumer a request's peak
is ``ceil(T / B)`` blocks (T = prompt + generated tokens - 1, the tokens whose
KV it holds at its last step) for full attention and with HMA off, and
``min(ceil(T / B), ceil((W - 1) / B) + 1)`` for a sliding-window group (the
window minimum, the series' allocation of external tokens); a request fits when
the pool's free blocks hold that peak. A measured per-request peak that is not
the predicted one fails the command (in a run with a preemption only the
full-attention groups are compared: :func:`prediction_mismatches`); the
admitted requests and the throughput ratio are reported beside the prediction
(timing never fails it).
"""

from __future__ import annotations

import math
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from hmastack.bench import throughput as thr
from hmastack.bench.report import column
from hmastack.bench.trees import round_order
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console, step
from hmastack.stack import series
from hmastack.stack.series import Stage

# model -> the layout it stands for
MODELS = {"gemma-5to1": "Gemma-3-like", "gemma-1to1": "gpt-oss-like"}
# The consumer's pool, per model, in blocks of one layer: the budgets of the
# throughput (memory-bound: 3 requests at once with HMA off; control: the whole
# batch fits with HMA off too).
CASES = {
    f"{layout} {case}": n for layout in MODELS.values() for case, n in thr.CASES.items()
}
MODEL_OF = {f"{layout} {case}": m for m, layout in MODELS.items() for case in thr.CASES}
# The producer holds the whole batch until the consumer has read it.
PRODUCER_LAYER_BLOCKS = thr.CONTROL_LAYER_BLOCKS
ROUNDS = {"quick": 1, "full": 2}
BLOCK_SIZE = 16  # hmastack_testkit.e2e.models.BLOCK_SIZE


def trees(stages: list[Stage]) -> list[tuple[str, int, bool]]:
    """(label, stage number, HMA) of the runs, the base first: the base with
    HMA off, then the first stage (of :func:`series.everything`) whose ``hma``
    names "nixl" with HMA on and, the witness, with HMA off."""
    nixl = series.first_with(stages, "nixl", "hma")
    if nixl is None:
        raise HmastackError(
            "no stage turns HMA on for NixlConnector",
            'name "nixl" in `hma` of the stage.toml of the stage that does',
        )
    return [
        (series.BASE, 0, False),
        (nixl.label, nixl.number, True),
        (f"{nixl.label} (HMA off)", nixl.number, False),
    ]


def witness(labels: list[str]) -> str:
    """The label of the witness run (memory-bound budgets only)."""
    return labels[-1]


def tokens_held(batch: dict) -> int:
    """Tokens whose KV a request holds at its last step."""
    return batch["prefix"] + batch["suffix"] + batch["max_tokens"] - 1


def predicted_blocks(groups: list[str], tokens: int, block_size: int) -> list[int]:
    """Per KV cache group (``Session.group_kinds``: ``FullAttentionSpec``,
    ``SlidingWindowSpec(32)``, ...): the peak blocks of one request holding
    ``tokens`` tokens (pure). With HMA off a sliding-window layer's spec is a
    ``FullAttentionSpec`` that keeps its window (``FullAttentionSpec(32)``):
    its blocks hold every token."""
    out = []
    for kind in groups:
        whole = math.ceil(tokens / block_size)
        window = re.match(r"(SlidingWindow|ChunkedLocalAttention)\w*\((\d+)\)", kind)
        if window is None:
            out.append(whole)
        else:
            w = int(window.group(2))
            out.append(min(whole, math.ceil((w - 1) / block_size) + 1))
    return out


def _windowed(kind: str) -> bool:
    return kind.startswith(("SlidingWindow", "ChunkedLocalAttention"))


def prediction_mismatches(runs: dict[tuple[str, str], list[dict]]) -> list[str]:
    """Runs whose consumer's per-request peak blocks are not the predicted
    ones (pure). A run with a preemption is checked in its full-attention
    groups only: a preempted request computes its prompt again in one chunk,
    and a sliding-window group holds every block of the chunk during that
    step (the window trims them afterwards)."""
    out = []
    for (case, label), rs in runs.items():
        for r in rs:
            if "error" in r:
                continue
            want = predicted_blocks(r["groups"], tokens_held(r["batch"]), BLOCK_SIZE)
            got = r["peak_request_blocks"]
            if r.get("preemptions"):
                keep = [not _windowed(k) for k in r["groups"]]
                want = [w for w, k in zip(want, keep, strict=True) if k]
                got = [g for g, k in zip(got, keep, strict=True) if k]
            if got != want:
                out.append(
                    f"{case} {label}: blocks per request {r['peak_request_blocks']}, "
                    f"predicted {want} (groups {r['groups']})"
                )
    return out


def plan(
    case: str, hma: bool, model_dir: Path, folder: Path, port: int, role: str
) -> dict:
    """The engine plan of one side of a pair (``hmastack_testkit.e2e.throughput``)."""
    return {
        "model": MODEL_OF[case],
        "model_dir": str(model_dir),
        "scenarios": [],
        "connector": "nixl",
        "hma": hma,
        "store_dir": str(folder),
        "pool_layer_blocks": CASES[case]
        if role == "consumer"
        else PRODUCER_LAYER_BLOCKS,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": thr.MAX_NUM_SEQS,
        "side_channel_port": port,
        "batch": thr.BATCH,
        "role": role,
    }


def run_pair(
    cfg: Config,
    trees: dict[str, Path],
    support: list[Path],
    models: Path,
    work: Path,
    name: str,
    case: str,
    hma: bool,
) -> dict:
    """Producer and consumer at once; the consumer's result, with the
    producer's blocks held after the read (or an ``error``)."""
    from hmastack.e2e.runner import free_port

    folder = work / "pairs" / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model_dir = models / MODEL_OF[case]
    sides = {
        role: plan(case, hma, model_dir, folder, free_port(), role)
        for role in ("producer", "consumer")
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            role: pool.submit(
                thr.run_one, cfg, trees, support, models, work, f"{name}-{role}", p
            )
            for role, p in sides.items()
        }
        done = {role: f.result() for role, f in futures.items()}
    consumer, producer = done["consumer"], done["producer"]
    if "error" in producer and "error" not in consumer:
        consumer = {**consumer, "error": f"producer: {producer['error']}"}
    consumer["producer_blocks_held_after_read"] = producer.get("blocks_held_after_read")
    consumer["producer_prefill_seconds"] = producer.get("prefill_seconds")
    return consumer


def producer_frees_from(stages: list[Stage]) -> int | None:
    """The number of the first stage whose ``[bench] checks`` names
    "producer-frees" (None: none)."""
    stage = series.first_with(stages, "producer-frees", "bench.checks")
    return None if stage is None else stage.number


def pair_leaks(
    runs: dict[tuple[str, str], list[dict]], freed_from: int | None
) -> list[str]:
    """Producers that still hold blocks after the consumer's read, from stage
    number ``freed_from`` on (the first stage whose ``[bench] checks`` names
    "producer-frees": from it an idle engine keeps polling its connector while
    blocks are held, so the producer frees what the consumer read; 0.13.0's
    producer keeps them while it is idle, the e2e scenario nixl-consume's base
    bug): reported, not checked, before it (pure)."""
    if freed_from is None:
        return []
    return [
        f"{case} {label}: the producer holds {r['producer_blocks_held_after_read']} "
        "blocks after the read"
        for (case, label), rs in runs.items()
        for r in rs
        if "error" not in r
        and r.get("stage", freed_from) >= freed_from
        and r.get("producer_blocks_held_after_read")
    ]


class Prediction(msgspec.Struct, kw_only=True):
    """One case and tree of :func:`predictions`."""

    groups: int
    blocks_predicted: list[int] = column("blocks per request (predicted)")
    blocks_measured: list[int] = column("blocks per request (measured)")
    free_blocks: int = column("free blocks")
    at_once_predicted: int = column("requests at once (predicted)")
    at_once_measured: list[int] = column("requests at once (measured)")
    preemptions: int
    nixl_blocks_read: list[int] = column("blocks read with NIXL")
    failed_loads: int = column("failed loads")


class NixlReport(thr.ThroughputReport, kw_only=True):
    """``throughput_nixl.json``: the throughput's report, with the layout's
    predictions beside the engine's figures and what the producer held."""

    predictions: dict[str, Prediction]
    prediction_mismatches: list[str]
    leaks: list[str]


def predictions(rows: list[dict], runs: dict) -> dict:
    """Per case and tree: blocks per request and requests at once, predicted
    from the layout and measured (pure)."""
    out = {}
    for row in rows:
        ok = [r for r in runs[(row["case"], row["tree"])] if "error" not in r]
        first = ok[0]
        want = predicted_blocks(
            first["groups"], tokens_held(first["batch"]), BLOCK_SIZE
        )
        fit = first["num_blocks"] // max(1, sum(want))
        out[f"{row['case']}: {row['tree']}"] = {
            "groups": len(first["groups"]),
            "blocks per request (predicted)": want,
            "blocks per request (measured)": first["peak_request_blocks"],
            "free blocks": first["num_blocks"],
            "requests at once (predicted)": min(
                fit, thr.MAX_NUM_SEQS, first["batch"]["requests"]
            ),
            "requests at once (measured)": row["max running"],
            "preemptions": row["preemptions"],
            "blocks read with NIXL": sorted({r["nixl_blocks_read"] for r in ok}),
            "failed loads": max(r["failed_loads"] for r in ok),
        }
    return out


def explanation(verdicts: dict) -> str:
    """Why a memory-bound throughput ratio differs from the ratio of admitted
    requests, from the measured parts of the consumer's time (pure)."""
    out = []
    for name, v in verdicts.items():
        if "step s median (base, tree)" not in v:
            continue
        (lb, lt), (sb, st) = v["load s (base, tree)"], v["batch s (base, tree)"]
        mb, mt = v["step s median (base, tree)"]
        out.append(
            f"{name}: {v['throughput ratio']:.2f}x with requests at once "
            f"{v['admitted (base → tree)']} (predicted "
            f"{v['predicted admitted ratio']:.2f}x): "
            f"{v['steps ratio (base / tree)']:.2f}x fewer engine steps, a median "
            f"step {mt * 1000:.1f} CPU ms against the base's {mb * 1000:.1f}; "
            f"NixlConnector's start_load_kv and get_finished {lt:.2f} of "
            f"{st:.2f} CPU s against {lb:.2f} of {sb:.2f}."
        )
    return " ".join(out)


def with_layout_prediction(rows: list[dict], runs: dict) -> list[dict]:
    """The rows with ``predicted running`` from the layout's blocks per
    request (:func:`predictions`), not from the measured peak, which a
    preemption inflates (pure)."""
    pred = predictions(rows, runs)
    return [
        {
            **r,
            "predicted running": pred[f"{r['case']}: {r['tree']}"][
                "requests at once (predicted)"
            ],
        }
        for r in rows
    ]


def headline(verdicts: dict, rounds: int) -> str:
    parts = []
    for name, v in verdicts.items():
        if not name.split(":")[0].endswith("memory-bound"):
            continue
        parts.append(
            f"{name}: {v['throughput ratio']:.2f}x the base's completed requests "
            f"per CPU second ({v['min']:.2f}-{v['max']:.2f}, {rounds} rounds), "
            f"requests at once {v['admitted (base → tree)']} (block counts predict "
            f"{v['predicted admitted ratio']:.2f}x)"
        )
    return "; ".join(parts) + "." if parts else "no run completed."


def run(cfg: Config, quick: bool) -> dict:
    """Every pair, alternating trees per round and case; the report."""
    from hmastack.e2e.engine import engine_support

    rounds = ROUNDS["quick" if quick else "full"]
    started = time.monotonic()
    stages = series.everything(cfg)
    runs_of = trees(stages)
    models, engines = thr.engine_trees(cfg, {k for _, k, _ in runs_of}, set(MODELS))
    specs = {label: (k, hma) for label, k, hma in runs_of}
    labels = list(specs)
    support = engine_support(cfg)
    work = cfg.build / "bench" / "throughput-nixl"
    runs: dict[tuple[str, str], list[dict]] = {}
    errors: dict[str, str] = {}
    for i in range(rounds):
        for case in CASES:
            for label in round_order(labels, i):
                if label == witness(labels) and not case.endswith("memory-bound"):
                    continue
                k, hma = specs[label]
                slug = re.sub(r"[^a-z0-9]+", "-", f"{case}-{label}".lower())
                name = f"{slug}-r{i}"
                with step(
                    f"throughput (NIXL P/D) round {i + 1}/{rounds}: {case}, {label}"
                ):
                    result = run_pair(
                        cfg, engines[k], support, models, work, name, case, hma
                    )
                result["stage"] = k
                if "error" in result:
                    errors.setdefault(label, f"{case} round {i}: {result['error']}")
                else:
                    console.print(
                        f"  {result['completed']} requests in "
                        f"{result['cpu_seconds']:.2f} CPU s, {result['steps']} "
                        f"steps, at most {result['max_running']} running, "
                        f"{result['nixl_blocks_read']} blocks read"
                    )
                runs.setdefault((case, label), []).append(result)
    rows = with_layout_prediction(thr.summarize(runs, labels, CASES), runs)
    verdicts = thr.judge(rows, labels, CASES)
    mismatches = thr.cache_mismatches(runs)
    return {
        "title": "P/D with NixlConnector: decode-side throughput under a KV budget",
        "method": "two vLLM 0.13.0 CPU engines per run, NIXL over UCX on 127.0.0.1 "
        f"({', '.join(f'{m} ({lay})' for m, lay in MODELS.items())}; B=16, "
        f"float32): the producer prefills {thr.BATCH['requests']} requests of "
        f"{thr.BATCH['prefix'] + thr.BATCH['suffix']} distinct tokens "
        "(max_tokens=1) in a pool that holds them all; the consumer gets them at "
        "once, reads every prompt token but the last with NIXL and generates "
        f"{thr.BATCH['max_tokens']} tokens each (greedy, max_num_seqs "
        f"{thr.MAX_NUM_SEQS}) in a pool of blocks of one layer "
        f"({', '.join(f'{c} {n}' for c, n in thr.CASES.items())}); base with HMA "
        f"off, {labels[1]} with HMA on, {labels[1]} with HMA off (the witness, "
        f"memory-bound only); trees alternating, {rounds} rounds; ratio = tree / "
        "base completed "
        "requests per CPU second of the consumer, per round",
        "batch": thr.BATCH,
        "cases": CASES,
        "rounds": rounds,
        "headline": headline(verdicts, rounds),
        "explanation": explanation(verdicts),
        "verdicts": verdicts,
        "predictions": predictions(rows, runs),
        "mismatches": mismatches,
        "prediction_mismatches": prediction_mismatches(runs),
        "leaks": pair_leaks(runs, producer_frees_from(stages)),
        "errors": errors,
        "runs": {f"{c} / {t}": rs for (c, t), rs in runs.items()},
        "rows": rows,
        "seconds": round(time.monotonic() - started),
    }


def failed(report: dict) -> list[str]:
    """A cached-token count that is not the prompt but its last token, a
    per-request peak that is not the predicted one, a producer holding blocks
    after the read, or a pair that did not run fails the command; timing never
    does."""
    return [
        *report.get("mismatches", []),
        *report.get("prediction_mismatches", []),
        *report.get("leaks", []),
        *(f"{label}: {e}" for label, e in report.get("errors", {}).items()),
    ]
