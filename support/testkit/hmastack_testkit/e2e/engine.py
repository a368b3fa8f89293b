"""One vLLM engine (``LLM``, engine core in-process) and what the scenarios read.

:class:`Session` builds the engine from a plan (model, HMA on/off, connector,
pool size, scheduler budget), runs requests step by step through
``LLMEngine.add_request`` / ``step`` so that the engine's state can be read after
every step (per-group block counts from the KV cache manager, running and
waiting requests, preemptions), and stops a run that makes no progress (a stall)
instead of hanging.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack_testkit.e2e.models import BLOCK_SIZE, MODELS, VOCAB

TOP_K = 5
STALL_STEPS = 200  # steps without a new token or a finished request
# A request waiting for a transfer by another process (NixlConnector) waits in
# wall-clock time, not in steps: idle steps then sleep, and a stall needs this
# long without progress too.
REMOTE_KV_SECONDS = 60.0
IDLE_SLEEP_SECONDS = 0.02


class Stall(Exception):
    """The engine made no progress for :data:`STALL_STEPS` steps."""


@dataclass
class RequestRecord:
    key: str
    prompt_len: int
    tokens: list[int]
    logprobs: list[list[tuple[int, float]]]  # per position: top-k (token, logprob)
    num_cached_tokens: int | None
    expected_cached: int | None = None  # None: not checked (reference run)
    kv_transfer_params: dict | None = None
    # what the engine returned in RequestOutput.kv_transfer_params (a P/D
    # producer's NixlConnector: the blocks a consumer reads, its side channel)
    returned_kv_transfer_params: dict | None = None


@dataclass
class Observation:
    """What the engine showed while a scenario ran."""

    steps: int = 0
    max_running: int = 0
    max_waiting: int = 0
    preemptions: int = 0
    # req key -> per KV cache group: most real (non-null) blocks it held at once
    peak_blocks: dict[str, list[int]] = field(default_factory=dict)
    # per KV cache group: most real blocks all requests held at once
    peak_total_blocks: list[int] = field(default_factory=list)
    # a P/D producer: blocks not back in the pool after the consumer's read
    blocks_held_after_read: int | None = None
    # KV cache events: requests predicted, mispredictions, events, batches,
    # sequence numbers missed
    kv_events: dict[str, int] = field(default_factory=dict)


def prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids in [3, VOCAB) drawn with ``seed`` (reproducible)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@dataclass
class Plan:
    """What one driver process runs (read from the plan JSON)."""

    model: str
    model_dir: Path
    scenarios: list[str]
    # "plain" | "hma" | "lmcache" | "nixl" | "offload" | None (reference)
    connector: str | None
    hma: bool
    store_dir: Path | None = None
    # KV cache pool in blocks of one layer (None: VLLM_CPU_KVCACHE_SPACE): the
    # same memory with HMA on and off (models.ModelSpec.num_blocks)
    pool_layer_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    async_scheduling: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)
    # the connector store's subfolder for every scenario (default: its name);
    # the two processes of a P/D pair name the same one
    namespace: str | None = None
    # NixlConnector: this engine's side channel port on 127.0.0.1
    side_channel_port: int | None = None
    # KV cache events published over ZMQ to a subscriber on 127.0.0.1
    # (hmastack_testkit.kv_events), with a connector only
    kv_events: bool = False

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        data = dict(data)
        data["model_dir"] = Path(data["model_dir"])
        if data.get("store_dir"):
            data["store_dir"] = Path(data["store_dir"])
        return cls(**data)


class Session:
    """One engine for one plan."""

    def __init__(self, plan: Plan):
        from vllm import LLM

        self.plan = plan
        kwargs: dict[str, Any] = dict(
            model=str(plan.model_dir),
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=BLOCK_SIZE,
            max_model_len=4096,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            max_num_seqs=plan.max_num_seqs,
            seed=0,
            disable_hybrid_kv_cache_manager=not plan.hma,
            # The reference computes every token: no prefix cache, no connector.
            enable_prefix_caching=plan.connector is not None,
        )
        if plan.pool_layer_blocks is not None:
            spec = MODELS[plan.model]
            kwargs["num_gpu_blocks_override"] = spec.num_blocks(
                plan.pool_layer_blocks, plan.hma
            )
        if plan.async_scheduling:
            kwargs["async_scheduling"] = True
        if plan.connector in ("plain", "hma"):
            kwargs["kv_transfer_config"] = {
                "kv_connector": "CPUTestHMAConnector"
                if plan.connector == "hma"
                else "CPUTestConnector",
                "kv_connector_module_path": "hmastack_testkit.e2e.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "store_dir": str(plan.store_dir),
                    **plan.extra_config,
                },
            }
        elif plan.connector == "lmcache":
            kwargs["kv_transfer_config"] = {
                "kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_both",
            }
        elif plan.connector == "offload":
            # vLLM's own offloading (what --kv-offloading-backend native sets:
            # OffloadingConnector, kv_both) with the CPU test spec and an
            # explicit second-tier size (native's num_cpu_blocks is 0, which
            # the spec refuses).
            from hmastack_testkit.e2e import offload_observe

            offload_observe.install()
            kwargs["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "CPUTestOffloadingSpec",
                    "spec_module_path": "hmastack_testkit.offloading",
                    "check_store_reads": True,
                    **plan.extra_config,
                },
            }
        elif plan.connector == "nixl":
            import os

            # The side channel and UCX stay on the loopback interface; on
            # CpuPlatform the KV cache itself is registered with NIXL (DRAM).
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(plan.side_channel_port)
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            from hmastack_testkit.e2e import nixl_observe

            nixl_observe.install()
            kwargs["kv_transfer_config"] = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
            }
        # The subscriber binds first: vLLM's publisher connects to an endpoint
        # without a wildcard.
        self.kv_events = None
        if plan.kv_events and plan.connector is not None:
            from vllm.config import KVEventsConfig

            from hmastack_testkit.kv_events import Subscriber

            self.kv_events = Subscriber()
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.kv_events.endpoint,
            )
        if MODELS[plan.model].architecture == "BambaForCausalLM":
            # Mamba layers: the CPU platform runs no Triton kernel.
            from hmastack_testkit import mamba_reference_kernels

            mamba_reference_kernels.install()
        start = time.monotonic()
        self.llm = LLM(**kwargs)
        self.init_seconds = time.monotonic() - start
        self._next_id = 0
        # The connector's store subfolder for the requests of one scenario.
        self.namespace = "default"

    # --- engine internals the scenarios read ---------------------------------------

    @property
    def scheduler(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    @property
    def kv_cache_config(self):
        return self.scheduler.kv_cache_config

    def group_kinds(self) -> list[str]:
        """Per KV cache group: its spec's class name and window, e.g.
        ``SlidingWindowSpec(32)`` or ``FullAttentionSpec``."""
        kinds = []
        for group in self.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            name = type(spec).__name__
            window = getattr(spec, "sliding_window", None) or getattr(
                spec, "attention_chunk_size", None
            )
            kinds.append(f"{name}({window})" if window else name)
        return kinds

    def real_blocks(self, req_id: str) -> list[int]:
        """Per KV cache group: the request's blocks that are not the null block."""
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return [
            sum(1 for b in m.req_to_blocks.get(req_id, ()) if not b.is_null)
            for m in managers
        ]

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache failed (requests still running?)")

    # --- running requests -------------------------------------------------------------

    def run(
        self,
        requests: list[tuple[str, list[int], dict | None, int | None]],
        max_tokens: int = 8,
        observation: Observation | None = None,
        max_steps: int = 5000,
    ) -> list[RequestRecord]:
        """Run ``requests`` (key, prompt token ids, kv_transfer_params, expected
        cached tokens) together, greedy, ``max_tokens`` each, with the top-k
        logprobs of every generated token. Raises :class:`Stall` when no request
        progresses for :data:`STALL_STEPS` steps."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        ids: dict[str, tuple[str, list[int], dict | None, int | None]] = {}
        for key, tokens, params, expected in requests:
            req_id = f"{key}#{self._next_id}"
            self._next_id += 1
            ids[req_id] = (key, tokens, params, expected)
            if params is not None and self.plan.connector in ("plain", "hma"):
                params = {"namespace": self.namespace, **params}
            extra = {"kv_transfer_params": params} if params else None
            sampling = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                min_tokens=max_tokens,
                logprobs=TOP_K,
                ignore_eos=True,
                extra_args=extra,
            )
            engine.add_request(req_id, {"prompt_token_ids": tokens}, sampling)
        from vllm.v1.request import RequestStatus

        finished: dict[str, Any] = {}
        idle = 0
        steps = 0
        progress_mark = None
        progress_at = time.monotonic()
        obs = observation or Observation()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            self._observe(obs, ids)
            mark = (
                len(finished),
                sum(r.num_computed_tokens for r in self.scheduler.requests.values()),
                sum(len(r.output_token_ids) for r in self.scheduler.requests.values()),
            )
            idle = idle + 1 if mark == progress_mark else 0
            progress_mark = mark
            if idle == 0:
                progress_at = time.monotonic()
            remote = any(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                for r in self.scheduler.waiting
            )
            if idle and remote and self.plan.connector == "nixl":
                time.sleep(IDLE_SLEEP_SECONDS)
                if time.monotonic() - progress_at < REMOTE_KV_SECONDS:
                    continue
            if idle >= STALL_STEPS or steps >= max_steps:
                raise Stall(
                    f"no progress for {idle} steps (step {steps}): "
                    f"{len(self.scheduler.running)} running, "
                    f"{len(self.scheduler.waiting)} waiting, "
                    f"{self.num_free_blocks()} free blocks"
                )
        obs.steps += steps
        records = []
        for req_id, (key, tokens, params, expected) in ids.items():
            out = finished[req_id]
            completion = out.outputs[0]
            logprobs = [
                sorted(
                    ((int(t), float(lp.logprob)) for t, lp in pos.items()),
                    key=lambda x: -x[1],
                )[:TOP_K]
                for pos in (completion.logprobs or [])
            ]
            records.append(
                RequestRecord(
                    key=key,
                    prompt_len=len(tokens),
                    tokens=list(completion.token_ids),
                    logprobs=[[list(x) for x in pos] for pos in logprobs],
                    num_cached_tokens=out.num_cached_tokens,
                    expected_cached=expected,
                    kv_transfer_params=params,
                    returned_kv_transfer_params=out.kv_transfer_params,
                )
            )
        return records

    def _observe(self, obs: Observation, ids: dict) -> None:
        sched = self.scheduler
        obs.max_running = max(obs.max_running, len(sched.running))
        obs.max_waiting = max(obs.max_waiting, len(sched.waiting))
        total = None
        for req_id, request in sched.requests.items():
            obs.preemptions = max(obs.preemptions, request.num_preemptions)
            blocks = self.real_blocks(req_id)
            total = (
                blocks
                if total is None
                else [a + b for a, b in zip(total, blocks, strict=False)]
            )
            if req_id in ids:
                key = ids[req_id][0]
                peak = obs.peak_blocks.get(key, [0] * len(blocks))
                obs.peak_blocks[key] = [
                    max(a, b) for a, b in zip(peak, blocks, strict=False)
                ]
        if total is not None:
            peak = obs.peak_total_blocks or [0] * len(total)
            obs.peak_total_blocks = [
                max(a, b) for a, b in zip(peak, total, strict=False)
            ]
