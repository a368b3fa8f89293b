"""Shared helpers of our stage tests: KV cache specs and requests built the way
vLLM's own tests build them, with one hashing setup for every stage.

Imported by ``patches/*/tests/test_*.py`` (``support/testkit`` is on
PYTHONPATH inside the stage matrix); it imports vLLM and Hypothesis, so it runs
in build/env only. The KV cache specs, groups, the CPU VllmConfig and its
scheduler are :mod:`hmastack_testkit.kv_layouts`'s (shared with the benchmark
scenarios), under the names the stage tests import from here.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from hmastack_testkit.kv_layouts import (  # noqa: F401 - the stage tests' names
    make_cpu_vllm_config,
    make_kv_cache_config,
    make_kv_cache_groups,
    make_request,
    make_scheduler,
    make_spec,
)

# The model policies (spec/HybridKVAlloc.tla) that describe this tree's stage
# 03: "SeriesAllocOnly" (stage 03's allocation alone, patches
# [03.2 Connector paths handle every KV cache group] to
# [03.3 Allocate only the external blocks]) and "SeriesAsCoded" (stage 03's
# commits). A replay fixture names the one it was
# generated for (fixtures/replay-small.cfg).
REPLAY_POLICIES = ("SeriesAllocOnly", "SeriesAsCoded")

init_none_hash(sha256)

# The KV cache group layouts the allocation properties of stages 1 and 2 draw
# from (kinds of ``make_spec``, one single-layer group each).
GROUP_KINDS = [
    ["full"],
    ["sliding_window"],
    ["chunked_local"],
    ["full", "sliding_window"],
    ["full", "sliding_window", "sliding_window"],
    ["full", "chunked_local"],
    ["full", "mamba"],
]


def model_runner_output(
    req_ids: list[str],
    sampled_token_ids: list[list[int]],
    kv_connector_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """The model runner's output of one step as the scheduler reads it: the
    tokens sampled for each scheduled request (in `req_ids` order), no
    logprobs or pooling, and the KV connector's reports."""
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled_token_ids,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )


def init_one_process_world() -> None:
    """A one-process vLLM world (gloo, on a free local port; tensor and
    pipeline parallel size 1) for code that asks for its ranks; the world
    that exists already, if one does."""
    import socket

    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=0,
        backend="gloo",
    )
    parallel_state.initialize_model_parallel(1, 1)


def hypothesis_settings(max_examples: int) -> settings:
    """Deterministic examples: the stage matrix must give the same verdict on every
    run (a property falsified by a random seed is recorded as a regular test)."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def example_settings(fixed_examples: int, steps: int | None = None) -> settings:
    """The settings of a property or state machine test: a fixed, derandomized
    set of `fixed_examples` examples (what CI runs), or with
    ``HMASTACK_RANDOM_EXAMPLES=N`` N examples from a fresh random seed (the
    blob of a failure printed to reproduce it). A state machine runs `steps`
    rules per example (``HMASTACK_RANDOM_STEPS=N`` sets another count).
    ``HMASTACK_RANDOM_NO_SHRINK`` (what ``hmastack conform`` sets on a broken
    tree) reports the first falsifying example without shrinking it."""
    per_example = {}
    if steps is not None:
        steps = int(os.environ.get("HMASTACK_RANDOM_STEPS", str(steps)))
        per_example["stateful_step_count"] = steps
    num_random = int(os.environ.get("HMASTACK_RANDOM_EXAMPLES", "0"))
    if num_random:
        chosen = settings(
            hypothesis_settings(num_random),
            derandomize=False,
            print_blob=True,
            **per_example,
        )
    else:
        chosen = settings(hypothesis_settings(fixed_examples), **per_example)
    if os.environ.get("HMASTACK_RANDOM_NO_SHRINK"):
        chosen = settings(chosen, phases=[Phase.explicit, Phase.generate])
    return chosen


def steer_free_queue(block_pool, m2r: dict, r2m: dict, model_blocks: list) -> None:
    """Put the blocks a model step takes at the head of vLLM's free queue.

    The model may take any free block (evicting a cached one); vLLM takes the
    head of its free block queue (LRU order). That order is the eviction policy,
    not a property under test, so a replay reorders the queue before the step:
    ``model_blocks`` (model block ids in vLLM's allocation order: group by
    group, table order) through the bijection ``m2r``/``r2m``; a block the model
    never used stands for one vLLM never used. A block that is not free yet
    (freed during the step) cannot be placed: the replay's eviction check then
    stops the trace if vLLM chose another block.
    """
    queue = block_pool.free_block_queue
    free = queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    unused = [b for b in free if b.block_id not in r2m]
    head = []
    for m in model_blocks:
        x = m2r.get(m)
        if x is None and unused:
            head.append(unused.pop(0))
        elif x is not None and x in free_ids:
            head.append(block_pool.blocks[x])
    head_ids = {b.block_id for b in head}
    for b in free:
        queue.remove(b)
    queue.append_n(head + [b for b in free if b.block_id not in head_ids])


def compare_pool(block_pool, m2r: dict, state: dict, num_blocks: int) -> list[str]:
    """Differences between a model state's pool (``ref``: ref count of model
    blocks 1..num_blocks, ``freeQ``: its free queue) and vLLM's block pool,
    through the bijection ``m2r`` (model block id -> vLLM block id; an unmapped
    block has ref count 0)."""
    problems = []
    for m in range(1, num_blocks + 1):
        x = m2r.get(m)
        real_ref = block_pool.blocks[x].ref_cnt if x is not None else 0
        if real_ref != state["ref"][m - 1]:
            problems.append(
                f"ref_cnt of model block {m} (vLLM {x}): model "
                f"{state['ref'][m - 1]}, vLLM {real_ref}"
            )
    if block_pool.get_num_free_blocks() != len(state["freeQ"]):
        problems.append(
            f"free blocks: model {len(state['freeQ'])}, "
            f"vLLM {block_pool.get_num_free_blocks()}"
        )
    return problems


def model_hit_blocks(m2r: dict, tables: dict, num_hit_blocks: int) -> list[int]:
    """The real ids of the blocks a model's prefix cache hit took: the first
    ``num_hit_blocks`` slots of each group's ``tables`` (model ids, null and
    unmapped ones left out), through the bijection ``m2r``."""
    return [
        m2r[m]
        for group_table in tables.values()
        for m in group_table[:num_hit_blocks]
        if m and m in m2r
    ]


def steer_hits(block_pool, real_blocks) -> None:
    """Make ``get_one_block`` return the given blocks for their keys.

    A prefix-cache key may name several blocks (``BlockHashToBlockMap`` keeps
    every block published under it); the model's hit may take any of them,
    vLLM takes the first of the key's dict. As with the free queue (see
    ``steer_free_queue``) that choice is not a property under test, so a
    replay moves the model's choice to the front before the lookup.
    """
    cache = block_pool.cached_block_hash_to_block._cache
    for x in real_blocks:
        block = block_pool.blocks[x]
        entry = cache.get(block.block_hash) if block.block_hash is not None else None
        if isinstance(entry, dict) and next(iter(entry)) != x and x in entry:
            cache[block.block_hash] = {x: block} | {
                k: v for k, v in entry.items() if k != x
            }


class AdmissionSpy:
    """Records what ``get_num_blocks_to_allocate`` of a KV cache coordinator
    returns (vLLM's own admission count), so a replay can compare it with the
    model's prediction, and refusals with refusals."""

    def __init__(self, coordinator):
        self.counts: list[int] = []
        self._count = coordinator.get_num_blocks_to_allocate
        coordinator.get_num_blocks_to_allocate = self._record

    def _record(self, *args, **kwargs) -> int:
        count = self._count(*args, **kwargs)
        self.counts.append(count)
        return count


class SkippedBlocksSpy:
    """Records the ``remove_skipped_blocks`` calls vLLM makes on a KV cache
    coordinator, so that a replay that frees the skipped blocks itself (to steer
    the eviction, see ``steer_free_queue``) can still check that vLLM's own
    ``allocate_slots`` asks for the same free."""

    def __init__(self, coordinator):
        self.calls: list[tuple[str, int]] = []
        self._remove = coordinator.remove_skipped_blocks
        coordinator.remove_skipped_blocks = self._record

    def _record(self, request_id: str, num_computed_tokens: int):
        self.calls.append((request_id, num_computed_tokens))
        return self._remove(request_id, num_computed_tokens)

    def free_now(self, request_id: str, num_computed_tokens: int):
        """The replay's own call (not recorded); what it returns (the blocks
        it freed, in a tree whose coordinator returns them)."""
        return self._remove(request_id, num_computed_tokens)


def bind_new_blocks(
    m2r: dict, r2m: dict, model_tables: dict, real_tables: dict, new_blocks: dict
) -> None:
    """Extend the bijection model block <-> vLLM block (``m2r``/``r2m``) with the
    blocks one step allocated, position by position in each group's table.

    ``model_tables`` and ``real_tables``: group -> block ids of one request after
    the step; ``new_blocks``: group -> the model's block ids allocated in the
    step. A block bound before (a freed block reused) is bound anew.
    """
    for group, model_ids in model_tables.items():
        fresh = set(new_blocks[group])
        for m, x in zip(model_ids, real_tables[group], strict=False):
            if m not in fresh:
                continue
            old_x = m2r.pop(m, None)
            if old_x is not None:
                r2m.pop(old_x, None)
            old_m = r2m.pop(x, None)
            if old_m is not None:
                m2r.pop(old_m, None)
            m2r[m], r2m[x] = x, m


def compare_table(request_id: str, real: dict, model: dict, r2m: dict) -> list[str]:
    """Differences between one request's block tables in vLLM (``real``: group ->
    vLLM block ids) and in a model state (``model``: group -> model block ids,
    0 the null block), through the bijection ``r2m`` (vLLM -> model id)."""
    problems = []
    for group, real_ids in real.items():
        mapped = [0 if x == 0 else r2m.get(x, f"?{x}") for x in real_ids]
        if mapped != model[group]:
            problems.append(
                f"table {request_id}.{group}: model {model[group]}, "
                f"vLLM {real_ids} = {mapped} as model ids"
            )
    return problems
