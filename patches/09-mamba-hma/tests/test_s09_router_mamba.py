"""Stage 09: the reference subscriber's index (``hmastack_testkit.kv_events``)
predicts the hits of OffloadingConnector's CPU tier for a Mamba hybrid.

The real Scheduler with a full attention and a Mamba group (16-token blocks,
prefix caching), OffloadingConnector with the testkit's CPU spec and KV cache
events; each published batch is encoded and decoded as a subscriber receives
it and applied to an :class:`Index`. Before each request the index predicts
its cached tokens, which the scheduler then reports. The local prefix cache
is emptied before every other request, so the CPU tier serves it.

With a Mamba group the tokens the tier loads end on the last block boundary
before the prompt's last token (the state after the last of them is loaded,
and the last token is computed from the state before it): a prompt of whole
blocks gets one block less than with attention layers alone. The rule of
attention layers alone (:meth:`Index.predict_tier` without the Mamba case)
predicts 63 of a 64-token prompt, where the scheduler reports 48.
"""

from __future__ import annotations

import pytest
import torch
from hmastack_testkit.kv_events import Index, decode_batch
from hmastack_testkit.kvtest import (
    make_cpu_vllm_config,
    make_kv_cache_config,
    make_request,
    make_scheduler,
)
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

BLOCK_SIZE = 16
NUM_BLOCKS = 64


class Engine:
    """The scheduler, the worker side of its connector and the index of its
    events."""

    def __init__(self):
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "CPUTestOffloadingSpec",
                "spec_module_path": "hmastack_testkit.offloading",
                "num_cpu_blocks": 160,
                "block_size": BLOCK_SIZE,
            },
        )
        config = make_cpu_vllm_config(
            BLOCK_SIZE,
            NUM_BLOCKS,
            transfer,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            ),
        )
        kv_cache_config = make_kv_cache_config(
            ["full", "mamba"], BLOCK_SIZE, None, NUM_BLOCKS
        )
        self.scheduler = make_scheduler(config, kv_cache_config)
        self.worker = OffloadingConnector(
            config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
        )
        self.worker.connector_worker._register_handlers(
            {
                name: torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 1, 1)
                for group in kv_cache_config.kv_cache_groups
                for name in group.layer_names
            },
            {},
        )
        self.index = Index()
        publisher = self.scheduler.kv_event_publisher
        publisher.publish = lambda batch: [
            self.index.apply(event) for event in decode_batch(batch).events
        ]
        self.next_id = 0

    def step(self) -> None:
        scheduler, worker = self.scheduler, self.worker
        output = scheduler.schedule()
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)
        if output.total_num_scheduled_tokens:
            worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        worker.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [600 + request.num_tokens % 50]
            if (request := scheduler.requests[r]).num_computed_tokens
            >= request.num_tokens
            else []
            for r in req_ids
        ]
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=sending or None,
                    finished_recving=recving or None,
                ),
            ),
        )

    def run(self, tokens: list[int]) -> tuple[int, int]:
        """(predicted, reported) cached tokens of a request of ``tokens``,
        run to its end and until its stores finished."""
        predicted = self.index.predict_tier(tokens)
        request = make_request(f"r{self.next_id}", tokens, BLOCK_SIZE, max_tokens=2)
        self.next_id += 1
        self.scheduler.add_request(request)
        for _ in range(100):
            self.step()
            if not self.scheduler.requests and not (
                self.scheduler.has_kv_connector_holds()
            ):
                break
        else:
            raise AssertionError(f"{request.request_id} did not finish")
        return predicted, request.num_cached_tokens

    def empty_local_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache()
        self.step()


@pytest.mark.parametrize(
    "num_tokens,num_tier_tokens", [(64, 48), (65, 64), (96, 80), (100, 96)]
)
def test_index_predicts_the_cpu_tier_hit_of_a_mamba_hybrid(
    num_tokens: int, num_tier_tokens: int
):
    """A prompt offloaded, then served by the CPU tier: the index predicts
    the tokens the scheduler reports, the last block boundary before the last
    token (48 of 64, 64 of 65, 80 of 96, 96 of 100)."""
    engine = Engine()
    tokens = [1000 + 7 * i for i in range(num_tokens)]
    assert engine.run(tokens) == (0, 0)
    engine.empty_local_prefix_cache()
    assert engine.index.predict(tokens) == 0
    predicted, reported = engine.run(tokens)
    assert reported == num_tier_tokens
    assert predicted == reported


def test_index_predicts_every_hit_with_shared_prefixes():
    """Prompts of whole blocks and not, sharing prefixes, the local prefix
    cache emptied before every other one: every hit is predicted, some of
    them served by the CPU tier."""
    engine = Engine()
    prefixes = [[2000 + 5 * i + p for i in range(n)] for p, n in enumerate((96, 130))]
    tier_hits = 0
    for i, (prefix, cut, extra) in enumerate(
        [(0, 0, 0), (0, 0, 0), (1, 2, 0), (1, 2, 16), (0, 32, 1), (1, 0, 14)] * 2
    ):
        if i % 2:
            engine.empty_local_prefix_cache()
        tokens = prefixes[prefix][: len(prefixes[prefix]) - cut]
        tokens += [9000 + 100 * i + j for j in range(extra)]
        local = engine.index.predict(tokens)
        predicted, reported = engine.run(tokens)
        assert predicted == reported, (i, len(tokens), predicted, reported)
        tier_hits += reported > local
    assert tier_hits >= 3
