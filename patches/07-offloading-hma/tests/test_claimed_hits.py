"""What OffloadingConnector claims, it loads.

A stateful random test (hypothesis) drives vLLM's ``Scheduler`` with
``OffloadingConnector`` over vLLM's LRU or ARC manager (a CPU backend of few
blocks, so that stores evict), and its worker side, whose transfers finish when
the test says: eagle on and off, on one full attention group, a full attention
and a sliding window group, and one sliding window group. Prompts share
prefixes, so later requests find them offloaded.

Stores finish 0 to 2 steps after they started. Rules: add a request (or one
with a prompt sent before), run engine steps (schedule, the worker side's load
and store, the report of finished transfers and failed loads, a sampled token
for every request past its prompt), let the CPU tier evict one offloaded block
of a prompt sent before (between steps: a lookup and its load run in one
``schedule()``), reset vLLM's prefix cache (a prompt sent again then hits the
CPU tier only), abort a request.

Property ``ClaimedHitLoadable``, after every step: every request to which the
connector gave external tokens in that step gets a load of every real block
the scheduler allocated for those tokens, in every KV cache group (a block of
its tables that holds an external token and is not the null block), and no
failed load. Nothing raises out of the scheduler.

CI runs a fixed, derandomized set (``HMASTACK_RANDOM_EXAMPLES=N``: N examples
with a fresh seed; ``HMASTACK_RANDOM_NO_SHRINK=1``: stop at the first failing
schedule, as ``hmastack conform`` does on broken trees).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from hmastack_testkit.kvtest import (
    example_settings,
    make_cpu_vllm_config,
    make_kv_cache_groups,
    make_request,
    make_scheduler,
)
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from vllm.attention.backends.abstract import AttentionBackend
from vllm.config import KVTransferConfig, SpeculativeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
    OffloadingConnectorMetadata,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager
from vllm.v1.kv_offload.arc_manager import ARCOffloadingManager
from vllm.v1.kv_offload.backends.cpu import CPUBackend
from vllm.v1.kv_offload.lru_manager import LRUOffloadingManager
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

BLOCK_SIZE = 16
WINDOW = 32
NUM_BLOCKS = 48  # the null block included
EOS = 2
LAYOUTS = {
    "full": ["full"],
    "full+window": ["full", "sliding_window"],
    "window": ["sliding_window"],
}

init_none_hash(sha256)

SETTINGS = example_settings(40, steps=40)


class MachineHandler(OffloadingHandler):
    """Transfers that move no data: a load finishes at the next
    ``get_finished``, a store at the ``store_delay``-th one after it
    started (the test sets it)."""

    def __init__(self):
        self.store_delay = 0
        self.loads: list[int] = []
        # [job id, get_finished calls left before it finishes]
        self.stores: list[list[int]] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, _ = spec
        if isinstance(src, GPULoadStoreSpec):
            self.stores.append([job_id, self.store_delay])
        else:
            self.loads.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        done = self.loads + [job_id for job_id, left in self.stores if left == 0]
        self.loads = []
        self.stores = [[job_id, left - 1] for job_id, left in self.stores if left > 0]
        return [(job_id, True) for job_id in done]


class MachineOffloadingSpec(OffloadingSpec):
    """vLLM's LRU or ARC manager (``eviction_policy``) over a CPU backend of
    ``num_cpu_blocks`` blocks; the transfers of :class:`MachineHandler`."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        backend = CPUBackend(
            block_size=self.offloaded_block_size,
            num_blocks=int(self.extra_config["num_cpu_blocks"]),
        )
        self.manager: OffloadingManager = (
            ARCOffloadingManager(backend)
            if self.extra_config["eviction_policy"] == "arc"
            else LRUOffloadingManager(backend)
        )
        self.handler = MachineHandler()

    def get_manager(self) -> OffloadingManager:
        return self.manager

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor], attn_backends
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.handler


def _evict(manager: OffloadingManager, key) -> None:
    """The CPU tier evicts a stored block that no load reads, as its
    prepare_store does."""
    if isinstance(manager, ARCOffloadingManager):
        tier = manager.t1 if key in manager.t1 else manager.t2
    else:
        assert isinstance(manager, LRUOffloadingManager)
        tier = manager.blocks
    block = tier.get(key)
    if block is not None and block.is_ready and block.ref_cnt == 0:
        manager.backend.free(tier.pop(key))


class ClaimedHitMachine(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        use_eagle=st.booleans(),
        policy=st.sampled_from(["lru", "arc"]),
        store_delay=st.integers(0, 2),
    )
    def setup(self, layout, use_eagle, policy, store_delay=0):
        ktc = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "MachineOffloadingSpec",
                "spec_module_path": __name__,
                "eviction_policy": policy,
                "num_cpu_blocks": 24,
            },
        )
        vllm_config = make_cpu_vllm_config(BLOCK_SIZE, NUM_BLOCKS, ktc, 4, 64)
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        if use_eagle:
            speculative_config = SpeculativeConfig(
                method="ngram", num_speculative_tokens=2
            )
            # The scheduler and the connector only ask use_eagle(); no
            # drafter runs here.
            object.__setattr__(speculative_config, "method", "eagle")
            vllm_config.speculative_config = speculative_config
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=make_kv_cache_groups(LAYOUTS[layout], BLOCK_SIZE, WINDOW),
        )
        self.scheduler = make_scheduler(vllm_config, kv_cache_config)
        assert self.scheduler.use_eagle == use_eagle
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, OffloadingConnector)
        self.worker = OffloadingConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        backend: type[AttentionBackend] = FlashAttentionBackend
        self.worker.register_cross_layers_kv_cache(torch.empty(0), backend)
        self.handler = self.worker.connector_worker.spec.handler
        self.handler.store_delay = store_delay
        self.num_requests = 0
        self.prompts: list[list[int]] = []
        # The locally computed tokens of each request's last lookup, and the
        # requests given external tokens in this step (with those tokens).
        self.lookups: dict[str, int] = {}
        self.allocated: dict[str, int] = {}
        lookup = self.connector.get_num_new_matched_tokens
        update_state_after_alloc = self.connector.update_state_after_alloc

        def lookup_spy(request, num_computed_tokens):
            self.lookups[request.request_id] = num_computed_tokens
            return lookup(request, num_computed_tokens)

        def update_state_after_alloc_spy(request, blocks, num_external_tokens):
            if num_external_tokens:
                self.allocated[request.request_id] = num_external_tokens
            return update_state_after_alloc(request, blocks, num_external_tokens)

        self.connector.get_num_new_matched_tokens = lookup_spy
        self.connector.update_state_after_alloc = update_state_after_alloc_spy

    @rule(
        prefix=st.integers(0, 1),
        prefix_len=st.sampled_from([96, 80, 64, 49, 48, 33, 32, 16, 0]),
        suffix_len=st.integers(1, 40),
        max_tokens=st.integers(1, 12),
    )
    def add_request(self, prefix, prefix_len, suffix_len, max_tokens):
        tokens = [100 + prefix + 7 * i for i in range(prefix_len)] + [
            1000 + self.num_requests
        ] * suffix_len
        self._add(tokens, max_tokens)

    @rule(pick=st.integers(0, 15), extra=st.integers(0, 20))
    def add_prompt_again(self, pick, extra):
        """A prompt sent before, with `extra` more tokens."""
        if self.prompts:
            tokens = self.prompts[pick % len(self.prompts)]
            self._add(tokens + [3] * extra, 4)

    def _add(self, tokens: list[int], max_tokens: int) -> None:
        req_id = f"r{self.num_requests}"
        self.num_requests += 1
        self.prompts.append(tokens)
        request = make_request(req_id, tokens, BLOCK_SIZE, max_tokens, EOS)
        self.scheduler.add_request(request)

    def _check_loads(self, meta: OffloadingConnectorMetadata) -> None:
        """ClaimedHitLoadable for the requests given external tokens in this
        step's schedule()."""
        allocated, self.allocated = self.allocated, {}
        manager = self.scheduler.kv_cache_manager
        # The loads the scheduler side found it cannot make (a tree whose
        # connector reports none has no such field).
        load_errors = getattr(meta, "load_errors", {})
        for req_id, num_external_tokens in allocated.items():
            num_local_tokens = self.lookups[req_id]
            assert req_id not in load_errors, (
                f"ClaimedHitLoadable violated: {req_id} claimed "
                f"{num_external_tokens} tokens after {num_local_tokens} computed "
                f"locally, but its load cannot load the blocks "
                f"{sorted(load_errors[req_id])}"
            )
            loaded: set[int] = set()
            if req_id in meta.reqs_to_load:
                _, gpu_spec = meta.reqs_to_load[req_id]
                loaded = {int(b) for b in gpu_spec.block_ids}
            first = num_local_tokens // BLOCK_SIZE
            last = -(-(num_local_tokens + num_external_tokens) // BLOCK_SIZE)
            real = {
                block_id
                for table in manager.get_block_ids(req_id)
                for block_id in table[first:last]
                if block_id != 0
            }
            assert loaded == real, (
                f"ClaimedHitLoadable violated: {req_id} claimed "
                f"{num_external_tokens} tokens after {num_local_tokens} computed "
                f"locally; its load writes blocks {sorted(loaded)}, the "
                f"scheduler allocated the real blocks {sorted(real)}"
            )

    @rule(eos=st.sets(st.integers(0, 3)), num_steps=st.integers(1, 6))
    def run(self, eos, num_steps):
        for _ in range(num_steps):
            self.step(eos)

    def step(self, eos):
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._check_loads(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(ForwardContext({}, {}, 0))
        if output.total_num_scheduled_tokens:
            self.worker.wait_for_save()
        finished_sending, finished_recving = self.worker.get_finished(
            output.finished_req_ids
        )
        invalid_block_ids = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for i, req_id in enumerate(req_ids):
            request = self.scheduler.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a chunk of the prompt
            else:
                sampled.append([EOS if i in eos else 7])
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=finished_sending,
                    finished_recving=finished_recving,
                    invalid_block_ids=invalid_block_ids,
                ),
            ),
        )

    @rule()
    def reset_prefix_cache(self):
        """vLLM's prefix cache loses what no request holds (as under memory
        pressure): a prompt sent again hits the CPU tier only."""
        self.scheduler.reset_prefix_cache()

    @rule(pick=st.integers(0, 15), position=st.integers(0, 7), group=st.integers(0, 1))
    def evict(self, pick, position, group):
        """The CPU tier evicts a block of a prompt sent before (at a block
        position, of a KV cache group)."""
        if not self.prompts:
            return
        tokens = self.prompts[pick % len(self.prompts)]
        request = make_request("evicted", tokens, BLOCK_SIZE)
        num_groups = len(self.scheduler.kv_cache_config.kv_cache_groups)
        if position >= len(request.block_hashes):
            return
        key = request.block_hashes[position]
        if num_groups > 1:
            key = BlockHash(make_block_hash_with_group_id(key, group % num_groups))
        _evict(self.connector.connector_scheduler.manager, key)

    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        req_ids = sorted(self.scheduler.requests)
        if req_ids:
            self.scheduler.finish_requests(
                req_ids[pick % len(req_ids)], RequestStatus.FINISHED_ABORTED
            )


ClaimedHitMachine.TestCase.settings = SETTINGS
test_claimed_hit_machine = ClaimedHitMachine.TestCase


def test_the_machine_loads_an_offloaded_prefix():
    """A fixed schedule: a prompt is offloaded, and a request with the same
    prefix gets a hit the connector loads (the machine's rules reach a load;
    with the fix it passes, eagle on)."""
    machine = ClaimedHitMachine()
    machine.setup("full+window", True, "lru")
    machine.add_request(0, 96, 8, 1)
    machine.run(set(), 4)
    assert not machine.scheduler.requests
    machine.add_request(0, 96, 12, 1)
    assert not machine.allocated
    output = machine.scheduler.schedule()
    assert machine.allocated
    meta = output.kv_connector_metadata
    assert meta.reqs_to_load
    machine._check_loads(meta)
