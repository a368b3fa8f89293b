"""Real-engine throughput under a KV budget (``hmastack bench --throughput``).

vLLM 0.13.0's engine on CPU (the end-to-end environment of ``hmastack e2e``,
``build/e2e-env``) serves a fixed batch of requests whose long prefixes come
from the CPU test connector (``hmastack_testkit.e2e.connector``), on the tiny
Gemma-3-like model (5 sliding-window layers, W=32, and 1 full-attention layer;
``hmastack_testkit.e2e.models``). One engine process per run
(``hmastack_testkit.e2e.throughput``); runs alternate between the trees (the
base and the stages whose ``[bench] throughput`` names the set: A B C, C B A,
...) within one invocation, for each KV budget:

* **memory-bound**: a pool of :data:`MEMORY_BOUND_LAYER_BLOCKS` blocks of one
  layer. The base runs as 0.13.0 does with a connector: HMA off (the plain
  test connector), so a block holds all 6 layers and every token of a request
  takes one (240 blocks: 3 requests of 65-69 blocks fit at once). From the
  stage whose ``hma`` names "test" HMA stays on with the connector that
  supports it (``SupportsHMA``): the
  full-attention group takes a block per 16 tokens, each sliding-window group
  only its window; the same memory holds the whole batch.
* **control** (negative control): :data:`CONTROL_LAYER_BLOCKS`, enough for the
  whole batch with HMA off too. The admitted requests are equal, and so should
  the throughput be (ratio about 1): the figure responds to the budget, not to
  something else that differs between the trees.

Per run: completed requests per second (wall clock of the measured batch; the
engine process's start-up and the store phase are outside), CPU seconds,
engine steps, the most requests running at once, the most blocks in use at
once (per KV cache group, and in blocks of one layer: a block with HMA off
holds every layer), preemptions, and every request's cached-token count (it
must equal its external hit; a mismatch fails the command). The ratio
tree/base is taken per round and reported as median (min-max) over the rounds.

What block counts predict: with each tree's per-request peak blocks (all groups
together, measured) and its pool, ``(blocks - 1) // per_request`` requests fit
at once (one null block reserved), at most the batch and ``max_num_seqs``. The
predicted ratio of admitted requests is the series' over the base's; the report
says whether the throughput ratio reaches it, and if not, what the remaining
time per request is (work that does not shrink with concurrency: the
connector's loads and the prefill of each request).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import msgspec

from hmastack.bench.report import ScenarioReport, column
from hmastack.bench.trees import round_order
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console, step
from hmastack.stack import series
from hmastack.stack.series import Stage

MODEL = "gemma-5to1"
LAYERS = 6  # layers of MODEL: a block holds all of them with HMA off
BATCH = {"requests": 16, "prefix": 1024, "suffix": 8, "max_tokens": 64}
MAX_NUM_SEQS = 16
# Blocks of one layer. HMA off: 1440 // 6 = 240 blocks; a request holds 65
# blocks when admitted (1032 tokens) and 69 at the end (1096): 3 fit at once.
# HMA on: 69 full-attention blocks and 3 per sliding-window group, 84 blocks:
# the 16 requests fit in 1440.
MEMORY_BOUND_LAYER_BLOCKS = 1440
# HMA off: 1200 blocks hold the 16 requests (69 blocks each) at once.
CONTROL_LAYER_BLOCKS = 6 * 1200
CASES = {"memory-bound": MEMORY_BOUND_LAYER_BLOCKS, "control": CONTROL_LAYER_BLOCKS}
ROUNDS = {"full": 3, "quick": 2}
PROCESS_TIMEOUT = 420.0  # seconds: start-up, store phase and the measured batch


def trees(stages: list[Stage], quick: bool) -> dict[str, tuple[int, bool]]:
    """The runs' trees, label -> (stage number, HMA on): the base with HMA
    off; in the full set also "base (HMA on)", 0.13.0 with HMA forced on (the
    SupportsHMA test connector: it separates what the hybrid manager's groups
    cost per step from what the series changes); the stages (of
    :func:`series.everything`) whose ``[bench] throughput`` names the set, HMA
    on from the first stage whose ``hma`` names "test"."""
    which = "quick" if quick else "full"
    out = {series.BASE: (0, False)}
    if not quick:
        out[f"{series.BASE} (HMA on)"] = (0, True)
    hma: set[str] = set()
    for s in stages[1:]:
        hma.update(s.info.hma)
        if which in s.info.bench.throughput:
            out[s.label] = (s.number, "test" in hma)
    return out


def plan(case: str, hma: bool, model_dir: Path, store: Path) -> dict:
    """The engine plan of one run (``hmastack_testkit.e2e.throughput``): with
    HMA on, the test connector that supports it."""
    return {
        "model": MODEL,
        "model_dir": str(model_dir),
        "scenarios": [],
        "connector": "hma" if hma else "plain",
        "hma": hma,
        "store_dir": str(store),
        "pool_layer_blocks": CASES[case],
        "max_num_batched_tokens": 2048,
        "max_num_seqs": MAX_NUM_SEQS,
        "batch": BATCH,
    }


def layer_blocks(blocks: list[int], hma: bool) -> int:
    """Blocks of one layer: with HMA off a block holds every layer."""
    return sum(blocks) * (1 if hma else LAYERS)


def predicted_concurrency(num_blocks: int, per_request: int, batch: int) -> int:
    """Requests that fit at once in ``num_blocks`` (one null block reserved),
    each holding ``per_request`` blocks (all KV cache groups together)."""
    if per_request <= 0:
        return batch
    return max(0, min(batch, MAX_NUM_SEQS, (num_blocks - 1) // per_request))


def run_one(
    cfg: Config,
    trees: dict[str, Path],
    support: list[Path],
    models: Path,
    work: Path,
    name: str,
    the_plan: dict,
) -> dict:
    """One engine process under a watchdog; its JSON (or an ``error``)."""
    from hmastack.e2e.engine import run_engine_process

    ran = run_engine_process(
        cfg,
        "hmastack_testkit.e2e.throughput",
        name,
        the_plan,
        trees,
        support,
        work,
        "0",
        PROCESS_TIMEOUT,
    )
    if ran.hung:
        return {"error": f"killed after {PROCESS_TIMEOUT:.0f} s (log: {ran.log})"}
    result = ran.result
    if result is None:
        return {"error": f"exit {ran.returncode}, no result (log: {ran.log})"}
    if "error" in result:
        result["error"] = result["error"].strip().splitlines()[-1][:300]
    return result


def _peak(run: dict) -> int:
    """The most blocks in use at once in a run (all KV cache groups)."""
    if "peak_blocks_in_use" in run:
        return run["peak_blocks_in_use"]
    return sum(run["peak_total_blocks"])


class ThroughputRow(msgspec.Struct, kw_only=True):
    """One case and tree of :func:`summarize`: requests per CPU second and
    per wall second over the rounds, their ratios to the base (None without
    a base round to pair), admission and blocks."""

    case: str
    pool_layer_blocks: int = column("pool layer blocks")
    tree: str
    hma: bool = column("HMA")
    kv_cache_groups: int = column("KV cache groups")
    blocks: int
    rounds: int
    rate_median: float = column("req/s median")
    rate_min: float = column("req/s min")
    rate_max: float = column("req/s max")
    ratio_median: float | None = column("ratio median")
    ratio_min: float | None = column("ratio min")
    ratio_max: float | None = column("ratio max")
    wall_rate_median: float = column("wall req/s median")
    wall_rate_min: float = column("wall req/s min")
    wall_rate_max: float = column("wall req/s max")
    wall_ratio_median: float | None = column("wall ratio median")
    wall_ratio_min: float | None = column("wall ratio min")
    wall_ratio_max: float | None = column("wall ratio max")
    s_median: float = column("s median")
    load_s_median: float | None = column("load s median")
    step_s_median: float | None = column("step s median")
    wall_s_median: float = column("wall s median")
    steps: list[int]
    max_running: list[int] = column("max running")
    per_request_blocks: int = column("per-request blocks")
    predicted_running: int = column("predicted running")
    peak_blocks: int = column("peak blocks")
    peak_layer_blocks: int = column("peak layer blocks")
    preemptions: int
    cached_tokens: list[int] = column("cached tokens")


class Verdict(msgspec.Struct, kw_only=True):
    """One case and tree of :func:`judge`; the load-free figures when both
    runs timed the connector's loads."""

    throughput_ratio: float = column("throughput ratio")
    min: float
    max: float
    wall_ratio: list[float] = column("wall ratio")
    admitted: str = column("admitted (base → tree)")
    predicted_admitted_ratio: float = column("predicted admitted ratio")
    measured_admitted_ratio: float = column("measured admitted ratio")
    steps_ratio: float = column("steps ratio (base / tree)")
    at_least_predicted: bool = column("at least predicted")
    load_s: list[float] | None = msgspec.field(default=None, name="load s (base, tree)")
    batch_s: list[float] | None = msgspec.field(
        default=None, name="batch s (base, tree)"
    )
    ratio_without_loads: float | None = msgspec.field(
        default=None, name="ratio without loads"
    )
    step_s: list[float | None] | None = msgspec.field(
        default=None, name="step s median (base, tree)"
    )


class ThroughputReport(ScenarioReport, kw_only=True):
    """``throughput.json``: the rows, the verdicts and the headline; ``runs``
    holds each engine process's own result as it wrote it
    (``tests/e2e/hmastack_e2e/throughput.py``), which only the writer reads."""

    title: str
    method: str
    batch: dict[str, int]
    cases: dict[str, int]  # case -> pool layer blocks
    rounds: int
    headline: str
    explanation: str
    verdicts: dict[str, Verdict]
    mismatches: list[str]
    errors: dict[str, str]
    runs: dict[str, list[dict]]
    rows: list[ThroughputRow]


def first_ok_hma(ok: list[dict]) -> bool:
    """Whether the runs had HMA on (their plan says)."""
    return bool(ok[0].get("plan", {}).get("hma", len(ok[0]["groups"]) > 1))


def summarize(
    runs: dict[tuple[str, str], list[dict]],
    labels: list[str],
    cases: dict[str, int] | None = None,
) -> list[dict]:
    """One row per (case, tree): completed requests per CPU second of the
    engine process (the figure) and per wall second (noisy on a shared
    machine), median (min-max) over rounds, the ratio to the base per round for
    both, admission and blocks (pure). ``cases``: name -> pool layer blocks
    (default :data:`CASES`)."""
    cases = CASES if cases is None else cases
    rows = []
    for case in cases:
        base_runs = runs.get((case, labels[0]), [])
        for label in labels:
            mine = runs.get((case, label), [])
            ok = [r for r in mine if "error" not in r]
            if not ok:
                continue
            hma = first_ok_hma(ok)
            pairs = [
                (a, b)
                for a, b in zip(mine, base_runs, strict=False)
                if "error" not in a and "error" not in b
            ]
            figures: dict[str, float | None] = {}
            for name, field in (("", "cpu_seconds"), ("wall ", "seconds")):
                rate = [r["completed"] / r[field] for r in ok]
                ratios = [
                    (a["completed"] / a[field]) / (b["completed"] / b[field])
                    for a, b in pairs
                ]
                figures |= {
                    f"{name}req/s median": round(statistics.median(rate), 3),
                    f"{name}req/s min": round(min(rate), 3),
                    f"{name}req/s max": round(max(rate), 3),
                    f"{name}ratio median": round(statistics.median(ratios), 3)
                    if ratios
                    else None,
                    f"{name}ratio min": round(min(ratios), 3) if ratios else None,
                    f"{name}ratio max": round(max(ratios), 3) if ratios else None,
                }
            first = ok[0]
            per_request = sum(first["peak_request_blocks"])
            rows.append(
                {
                    "case": case,
                    "pool layer blocks": cases[case],
                    "tree": label,
                    "HMA": hma,
                    "KV cache groups": len(first["groups"]),
                    "blocks": first["num_blocks"],
                    "rounds": len(ok),
                    **figures,
                    "s median": round(
                        statistics.median(r["cpu_seconds"] for r in ok), 3
                    ),
                    "load s median": round(
                        statistics.median(r["load_seconds"] for r in ok), 3
                    )
                    if all("load_seconds" in r for r in ok)
                    else None,
                    "step s median": round(
                        statistics.median(r["step_seconds_median"] for r in ok), 5
                    )
                    if all("step_seconds_median" in r for r in ok)
                    else None,
                    "wall s median": round(
                        statistics.median(r["seconds"] for r in ok), 3
                    ),
                    "steps": sorted({r["steps"] for r in ok}),
                    "max running": sorted({r["max_running"] for r in ok}),
                    "per-request blocks": per_request,
                    "predicted running": predicted_concurrency(
                        first["num_blocks"], per_request, first["batch"]["requests"]
                    ),
                    # At once, all groups (a run without peak_blocks_in_use:
                    # the sum of each group's own peak, an upper bound).
                    "peak blocks": max(_peak(r) for r in ok),
                    "peak layer blocks": max(layer_blocks([_peak(r)], hma) for r in ok),
                    "preemptions": max(r["preemptions"] for r in ok),
                    "cached tokens": sorted(
                        {c for r in ok for c in r["cached_tokens"]}
                    ),
                }
            )
    return rows


def judge(rows: list[dict], labels: list[str], cases: dict | None = None) -> dict:
    """The headline figures: per case and tree, the throughput ratio against
    the ratio of admitted requests the block counts predict (pure)."""
    by = {(r["case"], r["tree"]): r for r in rows}
    out = {}
    for case in CASES if cases is None else cases:
        base = by.get((case, labels[0]))
        if base is None:
            continue
        for label in labels[1:]:
            r = by.get((case, label))
            if r is None or r["ratio median"] is None:
                continue
            predicted = r["predicted running"] / max(1, base["predicted running"])
            measured = max(r["max running"]) / max(1, max(base["max running"]))
            loads = _load_free_ratio(by, case, labels[0], label)
            out[f"{case}: {label}"] = {
                "throughput ratio": r["ratio median"],
                "min": r["ratio min"],
                "max": r["ratio max"],
                "wall ratio": [
                    r["wall ratio median"],
                    r["wall ratio min"],
                    r["wall ratio max"],
                ],
                "admitted (base → tree)": f"{max(base['max running'])} → "
                f"{max(r['max running'])}",
                "predicted admitted ratio": round(predicted, 3),
                "measured admitted ratio": round(measured, 3),
                "steps ratio (base / tree)": round(
                    max(base["steps"]) / max(1, max(r["steps"])), 3
                ),
                "at least predicted": r["ratio median"] >= predicted,
                **loads,
            }
    return out


def _load_free_ratio(by: dict, case: str, base: str, label: str) -> dict:
    """The connector's load CPU seconds (median over rounds) of the base and
    the tree, and the ratio of the rest of the batch's CPU time (base / tree)."""
    b, t = by[(case, base)], by[(case, label)]
    if b.get("load s median") is None or t.get("load s median") is None:
        return {}
    rest_b = b["s median"] - b["load s median"]
    rest_t = t["s median"] - t["load s median"]
    return {
        "load s (base, tree)": [b["load s median"], t["load s median"]],
        "batch s (base, tree)": [b["s median"], t["s median"]],
        "ratio without loads": round(rest_b / rest_t, 3) if rest_t > 0 else None,
        "step s median (base, tree)": [b["step s median"], t["step s median"]],
    }


def explanation(verdicts: dict) -> str:
    """Why a memory-bound throughput ratio stays below the admitted ratio, from
    the measured parts of the batch's time (empty when it does not)."""
    out = []
    for name, v in verdicts.items():
        if not name.startswith("memory-bound") or v["at least predicted"]:
            continue
        if "ratio without loads" not in v:
            continue
        (lb, lt), (sb, st) = v["load s (base, tree)"], v["batch s (base, tree)"]
        (mb, mt) = v["step s median (base, tree)"]
        predicted = v["predicted admitted ratio"]
        out.append(
            f"{name}: {v['throughput ratio']:.2f}x, below the {predicted:.2f}x of "
            f"admitted requests. The connector's loads take {lb:.2f} CPU s of the "
            f"base's {sb:.2f} s and {lt:.2f} s of the tree's {st:.2f} s (median "
            "over rounds): every request reads its 64 block files however many run at "
            "once, so that time does not shrink with concurrency. The rest shrinks by "
            f"{v['ratio without loads']:.2f}x: the tree needs "
            f"{v['steps ratio (base / tree)']:.2f}x fewer engine steps, but a step "
            f"with 16 requests costs more than one with 3 (median step {mt * 1000:.1f} "
            f"ms against {mb * 1000:.1f} ms)."
        )
    for name, v in verdicts.items():
        if name.startswith("control") and "step s median (base, tree)" in v:
            (mb, mt) = v["step s median (base, tree)"]
            out.append(
                f"{name}: {v['throughput ratio']:.2f}x with the same requests running "
                f"at once ({v['admitted (base → tree)']}) and the same steps: a median "
                f"step takes {mt * 1000:.1f} CPU ms against the base's {mb * 1000:.1f} "
                "(HMA off: one KV cache group instead of six)."
            )
    return " ".join(out)


def headline(verdicts: dict, rounds: int) -> str:
    parts = []
    for name, v in verdicts.items():
        parts.append(
            f"{name}: {v['throughput ratio']:.2f}x the base's completed requests "
            f"per CPU second ({v['min']:.2f}-{v['max']:.2f} over {rounds} rounds; wall "
            f"clock {v['wall ratio'][0]:.2f}x, {v['wall ratio'][1]:.2f}-"
            f"{v['wall ratio'][2]:.2f}), requests running "
            f"at once {v['admitted (base → tree)']} (block counts predict "
            f"{v['predicted admitted ratio']:.2f}x)"
        )
    return "; ".join(parts) + "." if parts else "no run completed."


def cache_mismatches(runs: dict[tuple[str, str], list[dict]]) -> list[str]:
    """Every run's cache mismatches, named by case and tree."""
    return [
        f"{case} {label}: {m}"
        for (case, label), rs in runs.items()
        for r in rs
        for m in r.get("cache_mismatches", [])
    ]


def engine_trees(
    cfg: Config, stages: set[int], names: set[str]
) -> tuple[Path, dict[int, dict[str, Path]]]:
    """The end-to-end environment, the tiny models ``names`` and the trees of
    ``stages`` (``git am`` under ``build/bench/engine``, the compiled kernels
    placed)."""
    from hmastack.e2e import environment
    from hmastack.e2e.engine import ensure_models
    from hmastack.matrix import stages as matrix

    with step("the end-to-end environment (build/e2e-env)"):
        environment.ensure(cfg)
    models = ensure_models(cfg, cfg.build / "e2e" / "models", names)
    found = series.discover(cfg)
    trees: dict[int, dict[str, Path]] = {}
    for k in sorted(stages):
        if k > len(found):
            raise HmastackError(f"no stage number {k}", f"the series has {len(found)}")
        with step(f"{series.key_of(found, k)}: trees (git am) and compiled kernels"):
            t = matrix.stage_trees(cfg, found, k, root=cfg.build / "bench" / "engine")
            environment.place_kernels(cfg, t["vllm"])
            trees[k] = t
    return models, trees


def run(cfg: Config, quick: bool) -> dict:
    """Every run, alternating trees per round and case; the report."""
    from hmastack.e2e.engine import engine_support

    rounds = ROUNDS["quick" if quick else "full"]
    started = time.monotonic()
    specs = trees(series.everything(cfg), quick)
    models, engines = engine_trees(cfg, {k for k, _ in specs.values()}, {MODEL})
    labels = list(specs)
    support = engine_support(cfg)
    work = cfg.build / "bench" / "throughput"
    runs: dict[tuple[str, str], list[dict]] = {}
    errors: dict[str, str] = {}
    for i in range(rounds):
        for case in CASES:
            for label in round_order(labels, i):
                k, hma = specs[label]
                slug = label.replace(" ", "").replace("(", "-").replace(")", "")
                name = f"{case}-{slug}-r{i}"
                store = work / "store" / name
                the_plan = plan(case, hma, models / MODEL, store)
                with step(f"throughput round {i + 1}/{rounds}: {case}, {label}"):
                    result = run_one(
                        cfg, engines[k], support, models, work, name, the_plan
                    )
                if "error" in result:
                    errors.setdefault(label, f"{case} round {i}: {result['error']}")
                else:
                    rate = result["completed"] / result["seconds"]
                    console.print(
                        f"  {result['completed']} requests in "
                        f"{result['seconds']:.2f} s ({rate:.2f}/s), "
                        f"{result['steps']} steps, at most "
                        f"{result['max_running']} running"
                    )
                runs.setdefault((case, label), []).append(result)
    rows = summarize(runs, labels)
    verdicts = judge(rows, labels)
    mismatches = cache_mismatches(runs)
    return {
        "title": "Real-engine throughput under a KV budget",
        "method": f"vLLM 0.13.0's engine on CPU ({MODEL}: 5 sliding-window layers, "
        f"W=32, 1 full; B=16, float32), {BATCH['requests']} requests each with its "
        f"own {BATCH['prefix']}-token prefix stored in the CPU test connector and "
        f"loaded synchronously, {BATCH['suffix']} new prompt tokens, "
        f"{BATCH['max_tokens']} generated tokens, max_num_seqs {MAX_NUM_SEQS}; base "
        "with HMA off (plain connector, as 0.13.0 runs with a connector), the "
        "stages with HMA on where the test connector supports it (SupportsHMA), "
        "'base (HMA on)': 0.13.0 with HMA forced on (the SupportsHMA connector); "
        "pools in blocks of one layer "
        f"({', '.join(f'{c} {n}' for c, n in CASES.items())}); one engine process "
        f"per run, trees alternating, {rounds} rounds; ratio = tree / "
        "base requests per second per round",
        "batch": BATCH,
        "cases": CASES,
        "rounds": rounds,
        "headline": headline(verdicts, rounds),
        "explanation": explanation(verdicts),
        "verdicts": verdicts,
        "mismatches": mismatches,
        "errors": errors,
        "runs": {f"{c} / {t}": rs for (c, t), rs in runs.items()},
        "rows": rows,
        "seconds": round(time.monotonic() - started),
    }


def failed(report: dict) -> list[str]:
    """A cached-token count that is not the external hit fails the command (the
    connector did not serve the prefix); timing never does."""
    return list(report.get("mismatches", []))
