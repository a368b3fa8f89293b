"""What the end-to-end set runs: scenarios, engine settings, expectations.

A scenario's engine-side code is the function of the same name in
``hmastack_testkit.e2e.scenarios`` (``support/testkit``); this module says where
it runs (which stages, which engine settings, which model), what counts as
passing, and whether it is in the CI-sized set (``--quick``).

At every stage the connector matches what the stage supports: stages 0-2 run
with HMA off and the plain connector (``CPUTestConnector``), stages 3 and 4 with
HMA on and the HMA connector (``CPUTestHMAConnector``, ``SupportsHMA``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HMA_FROM_STAGE = 3
# KV cache events with HMA (the stage whose README is patches/*-kv-events-hma/):
# its scenarios run there and at the base (HMA off, the control).
KV_EVENTS_STAGE = 8
# vLLM's OffloadingConnector with HMA (patches/*-offloading-hma/): its
# scenarios run there, at the stage after it and at the base (HMA off).
OFFLOAD_STAGE = 7
OFFLOAD_HMA_STAGES = (OFFLOAD_STAGE, KV_EVENTS_STAGE)
# Scenarios the CPU engine of 0.13.0 cannot run, and why.
UNSUPPORTED = {
    "asynchronous scheduling": (
        "vLLM 0.13.0's model runner builds AsyncGPUModelRunnerOutput, which calls "
        "torch.cuda.current_stream(): on CPU the first step fails with "
        "'RuntimeError: Found no NVIDIA driver on your system' (measured at stage 0 "
        "with async_scheduling=True)"
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
    stages: tuple[int, ...] | None = None  # None: every stage
    # a known bug of the base that a stage fixes: before `fixed_at` the outputs
    # must differ (the scenario reproduces it), from `fixed_at` on be equal
    base_bug: str | None = None
    fixed_at: int | None = None
    base_bug_stalls: bool = False  # the base bug shows as an engine stall
    hma: bool | None = None  # None: on from stage 3 (the stage's connector)
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
    # with the stage's LMCache tree (HMA on only where both support it: stage 4);
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
        fixed_at=3,
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
            "(from stage 3 in a model with sliding-window groups: "
            "can_recompute_from says start over) takes no external tokens any "
            "more (patch 3.9); before that patch the connector that offers "
            "the same hit and fails again kept it in WAITING_FOR_REMOTE_KVS for ever"
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
        stages=(3, 4),
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
        fixed_at=3,
        base_bug_stalls=True,
        note=(
            "stages 0-2 stall (the base bug); from stage 3 the waiting requests give "
            "their blocks up when nothing else can run (patch 3.7), and the "
            "sliding-window groups keep ~3 blocks each"
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
        stages=(3, 4),
        note=(
            "stages 3-4: two requests back from their asynchronous loads wait "
            "holding 114 of 124 blocks, each needs 48 more (8 per group) for its "
            "next chunk; without patch 3.7 the engine stalls here as the "
            "base does, with it they finish"
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
        fixed_at=3,
    ),
    Scenario(
        "nixl-consume",
        "P/D with NixlConnector, chunked local attention (Llama-4-like)",
        connector="nixl",
        producer="nixl-produce",
        model="llama4-chunk",
        checks=("producer freed", "window", "read"),
        base_bug="as for the Gemma-3-like model: the producer keeps the blocks",
        fixed_at=3,
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
        fixed_at=3,
    ),
    Scenario(
        "server-pd-nixl",
        "vllm serve pair with NixlConnector and a proxy on 127.0.0.1, openai "
        "client: the completion equals a single engine's (tokens compared, no "
        "logprobs); the decode server reports the tokens it received",
        connector="nixl",
        isolated=True,
        stages=(0, 6),
    ),
    Scenario(
        "nixl-consume-failed-read",
        "P/D with NixlConnector, a read that fails (block ids past the "
        "producer's KV cache): the consumer recomputes",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        checks=("load failed",),
        stages=(0, 6),
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit (Gemma-3-like)",
        engine="kv-events",
        model="gemma-5to1",
        stages=(0, KV_EVENTS_STAGE),
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit "
        "(gpt-oss-like: 1:1 sliding/full)",
        engine="kv-events",
        model="gemma-1to1",
        stages=(0, KV_EVENTS_STAGE),
        checks=("kv events",),
    ),
    Scenario(
        "kv-events-router",
        "KV cache events: a subscriber predicts every prefix cache hit "
        "(Llama-4-like, chunked local attention)",
        engine="kv-events",
        model="llama4-chunk",
        stages=(0, KV_EVENTS_STAGE),
        checks=("kv events",),
    ),
    Scenario(
        "offload-reload",
        "vLLM's OffloadingConnector (CPU test spec): a 1064-token prompt served "
        "again from the second tier after the prefix cache is emptied "
        "(Gemma-3-like)",
        connector="offload",
        ci=True,
        stages=(0, *OFFLOAD_HMA_STAGES),
        checks=("window", "stored"),
    ),
    Scenario(
        "offload-reload",
        "OffloadingConnector: a prompt served again from the second tier "
        "(gpt-oss-like: 1:1 sliding/full)",
        connector="offload",
        model="gemma-1to1",
        stages=(0, *OFFLOAD_HMA_STAGES),
        checks=("window", "stored"),
    ),
    Scenario(
        "offload-reload",
        "OffloadingConnector: a prompt served again from the second tier "
        "(Llama-4-like, chunked local attention)",
        connector="offload",
        model="llama4-chunk",
        stages=(0, *OFFLOAD_HMA_STAGES),
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
        stages=OFFLOAD_HMA_STAGES,
        checks=("held",),
    ),
    # --- negative controls: each check must bite ----------------------------------
    Scenario(
        "control-offload-no-hold",
        "control: as offload-store-race, request_blocks_freed holds no block: "
        "the stores read blocks another request reused",
        connector="offload",
        engine="offload-race",
        ci=True,
        stages=OFFLOAD_HMA_STAGES,
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
        stages=(KV_EVENTS_STAGE,),
        expect="caught",
        caught_by="cached tokens",
    ),
    Scenario(
        "control-kv-events-without-group",
        "control: a subscriber that ignores the events' KV cache group "
        "mispredicts (gpt-oss-like)",
        engine="kv-events",
        model="gemma-1to1",
        stages=(KV_EVENTS_STAGE,),
        expect="caught",
        caught_by="cached tokens",
    ),
    Scenario(
        "control-kv-events-without-group",
        "control: a subscriber that ignores the events' KV cache group "
        "mispredicts (Llama-4-like)",
        engine="kv-events",
        model="llama4-chunk",
        stages=(KV_EVENTS_STAGE,),
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
        stages=(0,),
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
        stages=(6,),
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
        stages=(6,),
    ),
    Scenario(
        "control-nixl-group-not-read",
        "control: the NIXL consumer leaves the full-attention group out of its read",
        connector="nixl",
        producer="nixl-produce",
        ci=True,
        expect="caught",
        caught_by="outputs",
        stages=(6,),
    ),
    Scenario(
        "memory-window",
        "control: the base with HMA forced on keeps every external block",
        expect="caught",
        caught_by="window",
        hma=True,
        stages=(0,),
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


LMCACHE_HMA_FROM_STAGE = 4
# The first stage whose NixlConnector supports HMA (stage 06): before it the
# series turns HMA off for it, as 0.13.0 does.
NIXL_HMA_FROM_STAGE = 6


def hma_at(s: Scenario, stage: int) -> bool:
    if s.hma is not None:
        return s.hma
    if s.connector == "lmcache":
        return stage >= LMCACHE_HMA_FROM_STAGE
    if s.connector == "nixl":
        return stage >= NIXL_HMA_FROM_STAGE
    if s.connector == "offload":
        return stage >= OFFLOAD_STAGE
    return stage >= HMA_FROM_STAGE


def connector_at(s: Scenario, stage: int) -> str:
    if s.connector is not None:
        return s.connector
    return "hma" if hma_at(s, stage) else "plain"


def runs_at(s: Scenario, stage: int) -> bool:
    return s.stages is None or stage in s.stages
