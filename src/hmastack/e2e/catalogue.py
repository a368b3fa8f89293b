"""What the end-to-end set runs: scenarios, engine settings, expectations.

A scenario's engine-side code is the function of the same name in
``hmastack_testkit.e2e.scenarios`` (``support/testkit``); this module says where
it runs (which engine settings, which model), what counts as passing, and
whether it is in the CI-sized set (``--quick``). Where it runs and which stage
fixes a base bug is the stages' data (``[e2e]`` and ``hma`` of each
``patches/*/stage.toml``), read into one :class:`At` per stage.

At every stage the connector matches what the stage supports: HMA is on for a
connector from the first stage whose ``hma`` names it ("test": the testkit's
``CPUTestHMAConnector``, ``SupportsHMA``; before it the plain
``CPUTestConnector`` with HMA off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.stack import series

# Scenarios the CPU engine of 0.13.0 cannot run, and why.
UNSUPPORTED = {
    "asynchronous scheduling": (
        "vLLM 0.13.0's model runner builds AsyncGPUModelRunnerOutput, which calls "
        "torch.cuda.current_stream(): on CPU the first step fails with "
        "'RuntimeError: Found no NVIDIA driver on your system' (measured at the "
        "base with async_scheduling=True)"
    ),
    "OffloadingConnector's CUDA copies": (
        "vLLM's CPUOffloadingSpec refuses platforms that are not CUDA-alike and "
        "its handlers (CpuGpuOffloadingHandlers) copy with CUDA streams and "
        "ops.swap_blocks, registered for CUDA only: the scenarios load the CPU "
        "test spec (hmastack_testkit.offloading, through spec_name and "
        "spec_module_path), whose handlers copy whole blocks with torch; the "
        "connector's scheduler and worker sides and vLLM's LRU manager are "
        "vLLM's own"
    ),
}
# Largest allowed |logprob difference| between a run with the connector and the
# reference. HMA on vs off differ by ~2e-6 on these models (float32); a group
# not loaded moves them by > 0.1.
LOGPROB_TOLERANCE = 1e-4
BLOCK_SIZE = 16
WINDOW = 32


@dataclass(frozen=True)
class Engine:
    """Engine settings shared by the scenarios of one process."""

    name: str
    pool_layer_blocks: int | None = None  # KV cache pool, in blocks of one layer
    # with HMA on, if it needs another pool for the same effect (the series
    # needs far fewer blocks per request)
    pool_layer_blocks_hma: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    async_scheduling: bool = False
    # KV cache events to a subscriber on 127.0.0.1 (hmastack_testkit.kv_events)
    kv_events: bool = False
    # vLLM's OffloadingConnector with the CPU test spec
    # (hmastack_testkit.offloading): the second tier's size in blocks, and how
    # many steps after it started a store reads its GPU blocks
    num_cpu_blocks: int = 2048
    store_delay_steps: int = 0


ENGINES = {
    e.name: e
    for e in (
        Engine("default"),
        Engine("chunked", max_num_batched_tokens=32),
        # 4 requests with their own 256-token prefix, 19 blocks each and growing
        # by 6: 60 blocks (HMA off) force preemptions. With HMA on a request
        # holds ~25 full-attention blocks and ~3 per sliding-window group:
        # 150 blocks of one layer (a quarter of that memory) admit all four,
        # then force preemptions as they grow.
        Engine("tiny-pool", pool_layer_blocks=6 * 60, pool_layer_blocks_hma=150),
        # the facts file's stall: ~100 blocks (HMA off), two async loads of 47
        # blocks each, then 128 new tokens each (8 blocks) with 5 blocks free
        Engine("stall", pool_layer_blocks=6 * 100, max_num_batched_tokens=128),
        # the same with HMA on in a pool that its loads nearly fill too: 125
        # blocks of one layer hold both loads (47 + 5 x 2 blocks each) with 10
        # free, each then needs 8 blocks per group for its 128 new tokens
        Engine(
            "stall-tight",
            pool_layer_blocks=6 * 100,
            pool_layer_blocks_hma=125,
            max_num_batched_tokens=128,
        ),
        # room for 3 requests with a 512-token hit with HMA off
        Engine("admission", pool_layer_blocks=6 * 110),
        # KV cache events; a pool of ~4 requests of the stream (up to 16
        # blocks each with HMA off), so that it evicts
        Engine("kv-events", pool_layer_blocks=6 * 64, kv_events=True),
        # the same with OffloadingConnector, whose CPU tier publishes events
        # too: a pool of a few requests (up to ~30 blocks of all groups each
        # on Gemma-3-like) that evicts between the resets of the local prefix
        # cache, and a CPU tier of about six, which serves the requests after
        # a reset and evicts over the stream
        Engine(
            "kv-events-offload",
            pool_layer_blocks=6 * 20,
            kv_events=True,
            num_cpu_blocks=160,
        ),
        # OffloadingConnector's store race (Gemma-3-like, HMA on: six KV cache
        # groups of one layer): a 1064-token prefill takes 67 blocks per group,
        # 402 of the 411 the pool has; its stores read their blocks two steps
        # later, after the sliding-window groups freed 64 blocks each and a
        # second request could take them
        Engine("offload-race", pool_layer_blocks_hma=412, store_delay_steps=2),
    )
}


@dataclass(frozen=True)
class Scenario:
    name: str  # the engine-side function (dashes for underscores)
    title: str
    engine: str = "default"
    model: str = "gemma-5to1"
    ci: bool = False
    # "equal": outputs equal the reference and the cached-token counts match;
    # "caught": a negative control, the checks must fail (see `caught_by`)
    expect: str = "equal"
    caught_by: str | None = None  # "outputs" | "cached tokens" | "window"
    # True: it runs only at the stages (the base among them) whose stage.toml
    # names it in [e2e] run; False: at every stage
    listed: bool = False
    # a known bug of the base that a stage fixes (the one whose [e2e] fixes
    # names it): before it the outputs must differ (the scenario reproduces
    # it), from it on be equal
    base_bug: str | None = None
    base_bug_stalls: bool = False  # the base bug shows as an engine stall
    hma: bool | None = None  # None: as the stage has it for the connector
    # P/D pair: the producer scenario run first in another process
    producer: str | None = None
    # the producer's HMA setting when it differs from the consumer's (None: the
    # same): a producer with another KV cache group layout
    producer_hma: bool | None = None
    pythonhashseed: str = "0"
    checks: tuple[str, ...] = field(default_factory=tuple)
    # its own engine process: it may stall the engine (the scenarios after it
    # in a shared process would not run)
    isolated: bool = False
    # what a stall or failure of this scenario means (shown on the page)
    note: str | None = None
    # None: the stage's test connector; "lmcache": vLLM's LMCacheConnectorV1
    # with the stage's LMCache tree (HMA on where both support it);
    # "nixl": vLLM's NixlConnector, a P/D pair over NIXL and UCX on 127.0.0.1;
    # "offload": vLLM's OffloadingConnector with the CPU test spec
    connector: str | None = None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("sync-load", "synchronous load", ci=True),
    Scenario("async-load", "asynchronous load (WAITING_FOR_REMOTE_KVS)", ci=True),
    Scenario("local-then-external", "local prefix-cache hit, then external", ci=True),
    Scenario("ends-inside-block", "synchronous load ending inside a block"),
    Scenario(
        "ends-inside-block-async",
        "asynchronous load ending inside a block",
        ci=True,
        isolated=True,
        base_bug=(
            "an asynchronous load that ends inside a block resumes after all the "
            "block's slots: the engine reports 208 cached tokens for a 200-token "
            "hit and never computes tokens 200-207 (with a whole-block connector "
            "their KV happens to be right, so the outputs stay equal)"
        ),
    ),
    Scenario("whole-prompt", "whole prompt loaded, last token recomputed (P/D)"),
    Scenario(
        "whole-prompt-async",
        "whole prompt loaded asynchronously",
        ci=True,
    ),
    Scenario("batch-shared-prefix", "four requests sharing the prefix at once"),
    Scenario(
        "load-failure",
        "load failure (invalid blocks), recompute policy",
        checks=("load failed",),
    ),
    Scenario(
        "load-failure-async",
        "asynchronous load failure, recompute policy",
        ci=True,
        checks=("load failed",),
        isolated=True,
    ),
    Scenario(
        "load-failure-persistent",
        "async load failing at every attempt while the hit is offered again",
        ci=True,
        checks=("load failed",),
        isolated=True,
        note=(
            "a request whose asynchronous load failed and left no valid token "
            "(with HMA on in a model with sliding-window groups: "
            "can_recompute_from says start over) takes no external tokens any "
            "more; without that rule the connector that offers the same hit "
            "and fails again keeps it in WAITING_FOR_REMOTE_KVS for ever"
        ),
    ),
    Scenario(
        "chunked-prefill", "chunked prefill (32 tokens per step)", engine="chunked"
    ),
    Scenario(
        "preemption",
        "preemption under a tiny KV cache",
        engine="tiny-pool",
        checks=("preempted",),
    ),
    Scenario(
        "memory-window",
        "1024-token external hit: blocks per group",
        ci=True,
        checks=("window",),
    ),
    Scenario(
        "admission",
        "eight 512-token hits in a pool that holds three with HMA off",
        engine="admission",
        checks=("admission",),
    ),
    Scenario(
        "admission",
        "as admission, HMA off and the plain connector",
        engine="admission",
        hma=False,
        listed=True,
    ),
    Scenario("sync-load", "all-sliding-window model (one group)", model="mistral-swa"),
    Scenario("sync-load", "1:1 sliding/full alternation", model="gemma-1to1"),
    Scenario(
        "sync-load", "chunked local attention (Llama-4-like)", model="llama4-chunk"
    ),
    Scenario(
        "pd-load",
        "P/D: another process loads what a producer stored",
        ci=True,
        producer="pd-store",
    ),
    Scenario(
        "stall",
        "two long async loads in a tiny pool (known stall)",
        engine="stall",
        ci=True,
        isolated=True,
        base_bug=(
            "two requests back from their asynchronous loads wait in WAITING "
            "holding 94 of 99 blocks, each needs 8 more for its next chunk, none "
            "runs, so none frees: the engine stalls"
        ),
        base_bug_stalls=True,
        note=(
            "before the stage that fixes it the engine stalls (the base bug); "
            "from it the waiting requests give their blocks up when nothing "
            "else can run, and the sliding-window groups keep ~3 blocks each"
        ),
    ),
    Scenario(
        "server-smoke",
        "vllm serve on 127.0.0.1, openai client: the same completion twice "
        "(tokens compared, no logprobs)",
        ci=True,
        isolated=True,
    ),
    Scenario(
        "lmcache-load",
        "LMCache's own storage path (adapter, engine, local CPU backend)",
        connector="lmcache",
        ci=True,
        isolated=True,
    ),
    Scenario(
        "stall",
        "as stall, the pool nearly filled by the loads with HMA on too",
        engine="stall-tight",
        ci=True,
        isolated=True,
        listed=True,
        note=(
            "with HMA on, two requests back from their asynchronous loads wait "
            "holding 114 of 124 blocks, each needs 48 more (8 per group) for its "
            "next chunk; without the fix of the stall the engine stalls here as "
            "the base does, with it they finish"
        ),
    ),
    Scenario(
        "nixl-consume",
        "P/D with NixlConnector: the consumer reads the producer's blocks over "
        "NIXL (UCX on 127.0.0.1)",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        checks=("producer freed", "window", "read"),
        base_bug=(
            "the producer's engine stops stepping once it has no request left, so "
            "its connector never takes the consumer's notification and the blocks "
            "the consumer read stay held while the engine is idle"
        ),
    ),
    Scenario(
        "nixl-consume",
        "P/D with NixlConnector, chunked local attention (Llama-4-like)",
        connector="nixl",
        producer="nixl-produce",
        model="llama4-chunk",
        checks=("producer freed", "window", "read"),
        base_bug="as for the Gemma-3-like model: the producer keeps the blocks",
    ),
    Scenario(
        "nixl-consume",
        "P/D with NixlConnector, gpt-oss-like layout (sliding window and full "
        "attention alternating 1:1)",
        connector="nixl",
        producer="nixl-produce",
        model="gemma-1to1",
        checks=("producer freed", "window", "read"),
        base_bug="as for the Gemma-3-like model: the producer keeps the blocks",
    ),
    Scenario(
        "server-pd-nixl",
        "vllm serve pair with NixlConnector and a proxy on 127.0.0.1, openai "
        "client: the completion equals a single engine's (tokens compared, no "
        "logprobs); the decode server reports the tokens it received",
        connector="nixl",
        isolated=True,
        listed=True,
    ),
    Scenario(
        "nixl-consume-failed-read",
        "P/D with NixlConnector, a read that fails (block ids past the "
        "producer's KV cache): the consumer recomputes",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        checks=("load failed",),
        listed=True,
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit (Gemma-3-like)",
        engine="kv-events",
        model="gemma-5to1",
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit "
        "(gpt-oss-like: 1:1 sliding/full)",
        engine="kv-events",
        model="gemma-1to1",
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit "
        "(Llama-4-like, chunked local attention)",
        engine="kv-events",
        model="llama4-chunk",
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-offload-router",
        "KV cache events of the GPU and of OffloadingConnector's CPU tier: a "
        "subscriber predicts every hit, local or from the CPU tier (Gemma-3-like)",
        engine="kv-events-offload",
        connector="offload",
        ci=True,
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-offload-router",
        "KV cache events of the GPU and the CPU tier: a subscriber predicts "
        "every hit (gpt-oss-like: 1:1 sliding/full)",
        engine="kv-events-offload",
        connector="offload",
        model="gemma-1to1",
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-offload-router",
        "KV cache events of the GPU and the CPU tier: a subscriber predicts "
        "every hit (Llama-4-like, chunked local attention)",
        engine="kv-events-offload",
        connector="offload",
        model="llama4-chunk",
        listed=True,
        checks=("kv events",),
    ),
    Scenario(
        "offload-reload",
        "vLLM's OffloadingConnector (CPU test spec): a 1064-token prompt served "
        "again from the second tier after the prefix cache is emptied "
        "(Gemma-3-like)",
        connector="offload",
        ci=True,
        listed=True,
        checks=("window", "stored"),
    ),
    Scenario(
        "offload-reload",
        "OffloadingConnector: a prompt served again from the second tier "
        "(gpt-oss-like: 1:1 sliding/full)",
        connector="offload",
        model="gemma-1to1",
        listed=True,
        checks=("window", "stored"),
    ),
    Scenario(
        "offload-reload",
        "OffloadingConnector: a prompt served again from the second tier "
        "(Llama-4-like, chunked local attention)",
        connector="offload",
        model="llama4-chunk",
        listed=True,
        checks=("window", "stored"),
    ),
    Scenario(
        "offload-store-race",
        "OffloadingConnector: stores that read their blocks two steps late while "
        "the sliding windows free them and another request waits for blocks; "
        "prefixes of the stored prompt served from the second tier",
        connector="offload",
        engine="offload-race",
        ci=True,
        listed=True,
        checks=("held",),
    ),
    Scenario(
        "mamba-offload-reload",
        "OffloadingConnector on a Mamba hybrid (Bamba-like, reference Mamba "
        "kernels at the Triton boundary): a 200-token prompt served again from "
        "the second tier, 192 tokens (the last 64-token boundary before its last "
        "token)",
        connector="offload",
        model="bamba-like",
        listed=True,
        checks=("stored",),
    ),
    Scenario(
        "mamba-nixl-consume",
        "P/D with NixlConnector on a Mamba hybrid (Bamba-like): the consumer "
        "reads the attention blocks and the Mamba state block of the last "
        "boundary before the prompt's last token",
        connector="nixl",
        producer="nixl-produce",
        model="bamba-like",
        listed=True,
        checks=("read",),
    ),
    # --- negative controls: each check must bite ----------------------------------
    Scenario(
        "control-offload-no-hold",
        "control: as offload-store-race, request_blocks_freed holds no block: "
        "the stores read blocks another request reused",
        connector="offload",
        engine="offload-race",
        ci=True,
        listed=True,
        expect="caught",
        caught_by="connector findings",
        checks=("held",),
    ),
    Scenario(
        "control-kv-events-without-group",
        "control: a subscriber that ignores the events' KV cache group "
        "mispredicts (Gemma-3-like)",
        engine="kv-events",
        model="gemma-5to1",
        listed=True,
        expect="caught",
        caught_by="cached tokens",
    ),
    Scenario(
        "control-kv-events-without-group",
        "control: a subscriber that ignores the events' KV cache group "
        "mispredicts (gpt-oss-like)",
        engine="kv-events",
        model="gemma-1to1",
        listed=True,
        expect="caught",
        caught_by="cached tokens",
    ),
    Scenario(
        "control-kv-events-without-group",
        "control: a subscriber that ignores the events' KV cache group "
        "mispredicts (Llama-4-like)",
        engine="kv-events",
        model="llama4-chunk",
        listed=True,
        expect="caught",
        caught_by="cached tokens",
    ),
    Scenario(
        "control-lmcache-skip-layer",
        "control: LMCache's load leaves one layer of each group unwritten",
        connector="lmcache",
        ci=True,
        isolated=True,
        expect="caught",
        caught_by="outputs",
    ),
    Scenario(
        "control-skip-group",
        "control: one KV cache group (HMA off: one layer) not loaded",
        ci=True,
        expect="caught",
        caught_by="outputs",
    ),
    Scenario(
        "pd-load",
        "control: consumer with another PYTHONHASHSEED finds 0 tokens",
        ci=True,
        expect="caught",
        caught_by="cached tokens",
        producer="pd-store",
        pythonhashseed="1",
    ),
    Scenario(
        "control-nixl-rotated-blocks",
        "control: the NIXL consumer reads the producer's blocks in the wrong order",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        expect="caught",
        caught_by="outputs",
        listed=True,
    ),
    Scenario(
        "control-nixl-other-layout",
        "control: a NIXL producer with another KV cache group layout (HMA on, "
        "the consumer HMA off): the handshake refuses it, nothing is read",
        connector="nixl",
        producer="nixl-produce",
        hma=False,
        producer_hma=True,
        ci=True,
        expect="caught",
        caught_by="read",
        checks=("read",),
        listed=True,
    ),
    Scenario(
        "control-nixl-tables-of-another-layout",
        "control: a NIXL producer with HMA off, the consumer HMA on: its block "
        "table does not fit the consumer's groups, nothing is read",
        connector="nixl",
        producer="nixl-produce",
        hma=True,
        producer_hma=False,
        expect="caught",
        caught_by="read",
        checks=("read",),
        listed=True,
    ),
    Scenario(
        "control-nixl-group-not-read",
        "control: the NIXL consumer leaves the full-attention group out of its read",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        expect="caught",
        caught_by="outputs",
        listed=True,
    ),
    Scenario(
        "control-mamba-nixl-other-layers-state",
        "control: the NIXL consumer reads each Mamba group's state block from "
        "the producer's next Mamba group (another layer's state, Bamba-like)",
        connector="nixl",
        producer="nixl-produce",
        model="bamba-like",
        listed=True,
        expect="caught",
        caught_by="outputs",
    ),
    Scenario(
        "control-mamba-offload-zero-state",
        "control: the second tier's Mamba state blocks are zeroed before the "
        "reload (Bamba-like)",
        connector="offload",
        model="bamba-like",
        listed=True,
        expect="caught",
        caught_by="outputs",
    ),
    Scenario(
        "memory-window",
        "control: the base with HMA forced on keeps every external block",
        expect="caught",
        caught_by="window",
        hma=True,
        listed=True,
        checks=("window",),
    ),
)


def scenario_id(s: Scenario) -> str:
    """A scenario's unique name in the report: the function, plus what differs."""
    parts = [s.name]
    if s.model != "gemma-5to1":
        parts.append(s.model)
    if s.engine not in ("default",) and s.engine not in s.name:
        parts.append(s.engine)
    if s.pythonhashseed != "0":
        parts.append(f"hashseed-{s.pythonhashseed}")
    if s.hma is True:
        parts.append("hma-forced")
    if s.hma is False:
        parts.append("hma-off")
    return "/".join(parts)


def selected(quick: bool, only: str | None = None) -> list[Scenario]:
    return [
        s
        for s in SCENARIOS
        if (s.ci or not quick) and (only is None or only in scenario_id(s))
    ]


@dataclass(frozen=True)
class At:
    """A stage as the end-to-end set sees it: its key, the connectors with HMA
    on there, the listed scenarios it runs, and the scenarios whose base bug
    it or a stage before it fixes (with the stage that fixes each)."""

    key: str
    hma: frozenset[str] = frozenset()
    runs: frozenset[str] = frozenset()
    fixed: frozenset[str] = frozenset()
    fixed_at: dict[str, str] = field(default_factory=dict)


def named(s: Scenario, entries: frozenset[str] | list[str]) -> bool:
    """Whether ``entries`` (of a stage.toml) name ``s``: by its id, or by its
    name for every scenario of that name."""
    return scenario_id(s) in entries or s.name in entries


def stages(cfg: Config) -> list[At]:
    """The base and every stage as :class:`At`, in order; raises
    :class:`HmastackError` for a stage.toml entry that names no scenario, a
    listed scenario no stage runs, or a base bug that not exactly one stage
    fixes."""
    out, hma, fixed = [], set(), set()
    fixed_at: dict[str, str] = {}
    listed = [s for s in SCENARIOS if s.listed]
    for stage in series.everything(cfg):
        e2e = stage.info.e2e
        where = f"{stage.path / series.STAGE_FILE}: [e2e]"
        for entry in e2e.run:
            if not any(named(s, [entry]) for s in listed):
                raise HmastackError(
                    f"{where} run names no listed scenario: {entry!r}",
                    "listed: " + ", ".join(sorted({scenario_id(s) for s in listed})),
                )
        for entry in e2e.fixes:
            bugs = [s for s in SCENARIOS if s.base_bug and named(s, [entry])]
            if not bugs:
                raise HmastackError(
                    f"{where} fixes names no scenario with a base bug: {entry!r}",
                    "with a base bug: "
                    + ", ".join(scenario_id(s) for s in SCENARIOS if s.base_bug),
                )
            for s in bugs:
                if fixed_at.get(scenario_id(s), stage.key) != stage.key:
                    raise HmastackError(
                        f"{where} fixes {scenario_id(s)}, which stage "
                        f"{fixed_at[scenario_id(s)]} fixes already",
                        "one stage fixes a base bug",
                    )
                fixed_at[scenario_id(s)] = stage.key
                fixed.add(scenario_id(s))
        hma.update(stage.info.hma)
        out.append(At(stage.key, frozenset(hma), frozenset(e2e.run), frozenset(fixed)))
    for s in SCENARIOS:
        if s.base_bug and scenario_id(s) not in fixed_at:
            raise HmastackError(
                f"no stage fixes the base bug of {scenario_id(s)}",
                "name it in [e2e] fixes of the stage.toml of the stage that fixes it",
            )
        if s.listed and not any(named(s, at.runs) for at in out):
            raise HmastackError(
                f"no stage runs the listed scenario {scenario_id(s)}",
                "name it in [e2e] run of a stage.toml (patches/base/ for the base)",
            )
    return [At(at.key, at.hma, at.runs, at.fixed, dict(fixed_at)) for at in out]


def hma_at(s: Scenario, at: At) -> bool:
    if s.hma is not None:
        return s.hma
    return (s.connector or "test") in at.hma


def connector_at(s: Scenario, at: At) -> str:
    if s.connector is not None:
        return s.connector
    return "hma" if hma_at(s, at) else "plain"


def runs_at(s: Scenario, at: At) -> bool:
    return not s.listed or named(s, at.runs)


def base_bug_shows(s: Scenario, at: At) -> bool:
    """The scenario's base bug is not fixed yet at ``at``."""
    return bool(s.base_bug) and scenario_id(s) not in at.fixed
