"""Scenario 3: the scheduler's cost per step (schedule() + update_from_output()).

A real ``Scheduler`` of this tree on the CPU, fed a fake model runner output
(one sampled token per request that finished its prefill). Only the two
scheduler calls are measured, by the meter the orchestrator asks for
(``_meters.py``): CPU time, instructions counted by callgrind, or bytecodes per
Python function. The orchestrator alternates trees (one process per run) and
forms the ratios; nothing here fails on a figure.

A setting is (layout, connector, mode, requests):

* layout ``full``: one full-attention KV cache group (as vLLM's
  ``tests/v1/core/utils.py:create_scheduler``); ``gemma3``: one full-attention
  and five sliding-window groups (W=512); ``gptoss``: one full-attention and one
  sliding-window group (W=128). The hybrid layouts are where the series' code
  paths run (skipped tokens, null blocks, external tokens per group).
  ``longswa``: one sliding-window group (W=4096) and prompts of 124k tokens
  (7935 blocks), the context of the model's config less the decode steps: what
  a per-step scan of a request's block table costs.
* connector ``none``: no KV connector; ``connector``: the scripted
  ``ScriptedConnector`` (``hmastack_testkit.scripted_connector``), which
  reports the first 3/4 of every prompt (whole blocks) as an external hit
  loaded synchronously and records nothing but its calls (``track_blocks``
  off); ``hook``: the same with a ``request_blocks_freed``
  hook that holds nothing (``HoldingScriptedConnector``, whose stores read no
  block); ``offload``: vLLM's ``OffloadingConnector`` (its LRU manager over a
  CPU backend, ``hmastack_testkit.offloading.NoCopyOffloadingSpec``) with its
  worker side run between the measured calls, whose transfers finish at the
  next step and move no data: it stores every full block, is told of the
  finished stores and holds the blocks its stores read. The hybrid KV cache
  manager is then vLLM's decision (off on vLLM 0.13.0, whose
  OffloadingConnector does not support it): layouts of one KV cache group
  only, where it changes no block table.
* mode ``decode``: prompts admitted during the warm-up, then every step decodes
  one token for each request; ``prefill``: ``max_tokens=1``, every finished
  request is replaced by a fresh one between steps (outside the measured calls),
  so every step fills its token budget with (chunked) prefill.

HMA is on in every other setting (``disable_hybrid_kv_cache_manager=False``,
as ``--no-disable-hybrid-kv-cache-manager`` sets it; 0.13.0 allows it for a
connector that subclasses ``SupportsHMA``), so every tree runs the same KV cache
groups. Prefix caching on, prompts distinct.

Besides the figures, every row records the work done (tokens scheduled,
requests finished, connector calls): the same on every tree when they schedule
alike, so a ratio compares like work.
"""

from __future__ import annotations

import os
import sys

import _common as c
import _meters

BLOCK = 16
HIT_FRACTION = 0.75
# The scripted connector (scheduler side only: it moves no data) and its
# variant with the `request_blocks_freed` hook.
CONNECTOR_MODULE = "hmastack_testkit.scripted_connector"
CONNECTOR = "ScriptedConnector"
HOOK_CONNECTOR = "HoldingScriptedConnector"
OFFLOAD_SPEC_MODULE = "hmastack_testkit.offloading"
OFFLOAD_SPEC = "NoCopyOffloadingSpec"
SMALL = {"layout": "gemma3", "connector": "connector", "mode": "prefill"}

# Per layout: KV cache group kinds, the window (tokens) and prompt lengths.
# The model is a hub config from the offline cache (`hmastack env`; no weights):
# the scheduler reads its context length, the KV cache groups come from here.
LAYOUTS = {
    "full": {
        "model": "facebook/opt-125m",
        "window": 0,
        "decode_prompt": 64,
        "prefill_prompt": 1024,
    },
    "gemma3": {
        "model": "hmastack/gemma3-like-text",
        "window": 512,
        "decode_prompt": 1024,
        "prefill_prompt": 2048,
    },
    "gptoss": {
        "model": "hmastack/gpt-oss-like",
        "window": 128,
        "decode_prompt": 1024,
        "prefill_prompt": 2048,
    },
    "longswa": {
        "model": "hmastack/gpt-oss-like",
        "window": 4096,
        "decode_prompt": 131072 - 4096 - 16,  # max_model_len: the config's context
        "prefill_prompt": 131072 - 4096 - 16,
    },
}
SWA_ONLY = {"longswa"}  # layouts of one sliding-window group
PREFILL_BUDGET = 8192  # max_num_batched_tokens of the prefill-heavy mode
# Unmeasured steps before the measured ones. Python 3.11 quickens a function
# after several calls and specializes its instructions adaptively: with only a
# couple of warm-up steps, the first measured steps of a process still pay for
# that (several percent more instructions in the first setting of a process).
WARMUP_STEPS = 12
DECODE_STEPS_AHEAD = 4096  # max_tokens of a decoding request (never reached)


def layout_kinds(layout: str) -> list[str]:
    if layout in SWA_ONLY:
        return ["swa"]
    return ["full"] if layout == "full" else c.pattern_groups(layout)


def cost_scheduler(
    layout: str,
    hit_tokens: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_blocks: int,
    connector: str = CONNECTOR,
    offload: bool = False,
):
    """A ``Scheduler`` of this tree for ``layout`` (HMA on), with the scripted
    ``connector`` when ``hit_tokens`` is not None, or OffloadingConnector with
    ``offload`` (HMA then as vLLM decides). The model is a hub config only
    (offline cache; no weights, no tokenizer)."""
    from hmastack_testkit.kv_layouts import make_scheduler
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=LAYOUTS[layout]["model"],
        dtype="float32",
        seed=42,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=None if offload else False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK,
        gpu_memory_utilization=0.9,
        swap_space=0,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    kv_transfer_config = None
    if hit_tokens is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            # The double records nothing but its calls: the measured calls
            # are the scheduler's.
            kv_connector_extra_config={
                "offer_tokens": hit_tokens,
                "track_blocks": False,
            },
        )
    if offload:
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": OFFLOAD_SPEC,
                "spec_module_path": OFFLOAD_SPEC_MODULE,
                "num_cpu_blocks": num_blocks,
                "eviction_policy": "lru",
            },
        )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
    )
    kv_cache_config = c.kv_cache_config(
        layout_kinds(layout), LAYOUTS[layout]["window"], BLOCK, num_blocks
    )
    cache_config.num_gpu_blocks = num_blocks
    sched = make_scheduler(vllm_config, kv_cache_config, log_stats=True)
    if hit_tokens is not None:
        assert type(sched.connector).__name__ == connector, type(sched.connector)
    if offload:
        assert type(sched.connector).__name__ == "OffloadingConnector"
    return sched


def offloading_worker(sched):
    """The worker side of the scheduler's OffloadingConnector (no KV cache
    tensor: its transfers move no data)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    worker = OffloadingConnector(
        sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config
    )
    worker.register_cross_layers_kv_cache(torch.empty(0), FlashAttentionBackend)
    return worker


def requests(count: int, prompt: int, max_tokens: int, first_id: int = 0):
    """``count`` requests with distinct prompts of ``prompt`` tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    out = []
    for i in range(first_id, first_id + count):
        tokens = [(i * 7919 + j) % 50000 + 1 for j in range(prompt)]
        out.append(
            Request(
                request_id=str(i),
                prompt_token_ids=tokens,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                pooling_params=None,
                eos_token_id=None,
                block_hasher=hasher,
            )
        )
    return out


class Workload:
    """One setting: the scheduler, its pool of requests and the fake runner."""

    def __init__(self, setting: dict, steps: int):
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self._mro = ModelRunnerOutput
        self._kv_output = KVConnectorOutput
        self._forward_context = ForwardContext({}, {}, 0)
        self.setting = setting
        layout, mode = setting["layout"], setting["mode"]
        n = setting["requests"]
        lay = LAYOUTS[layout]
        groups = len(layout_kinds(layout))
        prompt = lay[f"{mode}_prompt"]
        hit = None
        if setting["connector"] in ("connector", "hook"):
            hit = int(prompt * HIT_FRACTION) // BLOCK * BLOCK
        computed = prompt - (hit or 0)
        warmup = WARMUP_STEPS
        if mode == "decode":
            # Every prompt admitted within the first warm-up step.
            batched, max_tokens = max(PREFILL_BUDGET, n * computed), DECODE_STEPS_AHEAD
            pool_size = n
            blocks_per_req = (prompt + warmup + steps + 2 * BLOCK) // BLOCK + 1
        else:
            batched, max_tokens = PREFILL_BUDGET, 1
            # At most batched // computed-per-request requests finish per step.
            pool_size = n + (steps + warmup) * (batched // computed + 1)
            blocks_per_req = prompt // BLOCK + 2
        self.prompt, self.hit, self.warmup = prompt, hit, warmup
        self.sched = cost_scheduler(
            layout,
            hit,
            max_num_seqs=n,
            max_num_batched_tokens=batched,
            max_model_len=prompt + DECODE_STEPS_AHEAD + BLOCK,
            num_blocks=groups * n * blocks_per_req + 16,
            connector=HOOK_CONNECTOR if setting["connector"] == "hook" else CONNECTOR,
            offload=setting["connector"] == "offload",
        )
        self.worker = None
        if setting["connector"] == "offload":
            self.worker = offloading_worker(self.sched)
        self.pool = requests(pool_size, prompt, max_tokens)
        self.pool.reverse()
        self.work = {"scheduled_tokens": 0, "finished": 0, "running_sum": 0}

    def top_up(self) -> None:
        n = self.setting["requests"]
        while self.pool and len(self.sched.requests) < n:
            self.sched.add_request(self.pool.pop())

    def step(self, meter: _meters.Meter) -> None:
        sched = self.sched
        out = meter.call(sched.schedule)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = sched.requests[rid]
            # schedule() already advanced num_computed_tokens.
            sampled.append([0] if r.num_computed_tokens >= r.num_prompt_tokens else [])
        mro = self._mro(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=self.run_worker(out),
        )
        meter.call(sched.update_from_output, out, mro)
        self.work["scheduled_tokens"] += out.total_num_scheduled_tokens
        self.work["finished"] += len(out.finished_req_ids)
        self.work["running_sum"] += len(ids)
        self.top_up()

    def run_worker(self, out):
        """The worker side of OffloadingConnector for the step (between the
        measured calls): its loads and stores, and what finished."""
        if self.worker is None:
            return None
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(self._forward_context)
        worker.wait_for_save()
        sending, recving = worker.get_finished(out.finished_req_ids)
        worker.clear_connector_metadata()
        return self._kv_output(finished_sending=sending, finished_recving=recving)

    def run(self, meter: _meters.Meter, steps: int, label: str) -> dict:
        self.top_up()
        plain = _meters.Meter()
        for _ in range(self.warmup):
            self.step(plain)
        self.work = dict.fromkeys(self.work, 0)
        meter.begin(label)
        for _ in range(steps):
            self.step(meter)
        figures = meter.end(label)
        s = self.setting
        sched_config = self.sched.vllm_config.scheduler_config
        row = {
            **s,
            "window": LAYOUTS[s["layout"]]["window"],
            "groups": len(layout_kinds(s["layout"])),
            "steps": steps,
            "hit_tokens": self.hit or 0,
            "prompt_tokens": self.prompt,
            "scheduled_tokens": self.work["scheduled_tokens"],
            "finished": self.work["finished"],
            "scheduled_per_step": round(self.work["running_sum"] / steps, 1),
            "pool_left": len(self.pool),
            "hma": not sched_config.disable_hybrid_kv_cache_manager,
            **figures,
        }
        if self.sched.connector is not None and self.worker is None:
            row["connector_calls"] = dict(self.sched.connector.calls)
        return row


def setting_label(s: dict) -> str:
    label = f"{s['layout']}-{s['connector']}-{s['mode']}-{s['requests']}"
    return label + (f"-b{s['ballast']}" if s.get("ballast") else "")


def ballast(count: int) -> list:
    """``count`` small objects of assorted sizes, kept alive while a setting
    runs: they move where the memory allocator places what the scheduler
    allocates. Each round of a benchmark uses another count, so the spread of a
    tree's counts over rounds shows how much of a count depends on that
    placement rather than on the code (identical runs repeat exactly)."""
    return [
        (i, "x" * (i % 61), [None] * (i % 7), {i: i} if i % 3 == 0 else None)
        for i in range(count)
    ]


def settings_from(a: dict) -> list[dict]:
    """The settings of a run: ``settings`` as given, else the product of
    ``layouts`` x ``connectors`` x ``modes`` x ``sizes``."""
    if "settings" in a:
        return list(a["settings"])
    return [
        {"layout": lay, "connector": con, "mode": mode, "requests": n}
        for lay in a.get("layouts", ["full"])
        for con in a.get("connectors", ["none", "connector"])
        for mode in a.get("modes", ["decode", "prefill"])
        for n in a.get("sizes", [64, 256])
    ]


def third_party_modules() -> list[str]:
    """Top-level modules imported so far that are neither this tree's, nor the
    scenarios', nor vLLM's (in import order): what the fork server preloads."""
    tree = os.path.realpath(os.getcwd()) + os.sep
    here = os.path.dirname(os.path.realpath(__file__)) + os.sep
    out = []
    for name, module in list(sys.modules.items()):
        if "." in name or "vllm" in name or name == "__main__":
            continue
        path = getattr(module, "__file__", None)
        if path and os.path.realpath(path).startswith((tree, here)):
            continue
        out.append(name)
    return out


def main() -> None:
    a = c.args()
    steps = int(a.get("steps", 20))
    if a.get("list_modules"):
        # One small setting, so that what a run imports lazily is imported too.
        Workload({**SMALL, "requests": 8}, 1).run(_meters.Meter(), 1, "probe")
        c.emit({"modules": third_party_modules(), **c.tree_info()})
        return
    meter = _meters.make(a)
    rows = []
    for s in settings_from(a):
        s = {**s, "ballast": int(s.get("ballast", a.get("ballast", 0)))}
        kept = ballast(s["ballast"])
        workload = Workload(s, steps)
        rows.append(workload.run(meter, steps, setting_label(s)))
        del workload, kept
    c.emit(
        {
            "meter": meter.name,
            "steps": steps,
            "hit_fraction": HIT_FRACTION,
            "rows": rows,
            **c.tree_info(),
        }
    )


if __name__ == "__main__":
    main()
