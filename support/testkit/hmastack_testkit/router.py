"""A router built only from the KV cache events, beside the real ``Scheduler``.

The scheduler publishes its events through vLLM's own ZMQ publisher
(``--kv-events-config`` with ``publisher: zmq``) to the reference subscriber
of :mod:`hmastack_testkit.kv_events` on 127.0.0.1, which decodes them with
structs of its own and keeps the router's index. Requests run one after
another; before each one the subscriber has received every event so far and
predicts the request's cached tokens, which the scheduler then reports
(``Request.num_cached_tokens``). With ``offloading``, OffloadingConnector
(vLLM's LRU manager over a CPU backend, its worker side with the testkit's
CPU spec) adds its CPU tier's events. The stage tests of the KV cache events
(08) and of Mamba hybrids (09) run it on their layouts.
"""

from __future__ import annotations

import random
import time

import torch
from vllm.config import KVEventsConfig, KVTransferConfig, SpeculativeConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput

from hmastack_testkit.kv_events import Index, Subscriber
from hmastack_testkit.kvtest import (
    make_cpu_vllm_config,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    model_runner_output,
)

BLOCK_SIZE = 16
WINDOW = 32
# Shared prompt prefixes: a request takes one, cut, plus tokens of its own.
PREFIXES = [[1000 + 7 * i + p for i in range(n)] for p, n in enumerate((70, 165, 300))]
EAGLE_CONTROL = "without_eagle"
# The control of the CPU tier with eagle: the engine's own eagle rule (a hit
# needs the block after it) applied to the tier's events.
TIER_CONTROL = "tier_engine_rule"


class Router:
    """The scheduler of one configuration, its events' subscriber and the
    requests run one after another."""

    def __init__(
        self,
        kinds: list[str],
        num_blocks: int,
        use_eagle: bool,
        offloading: bool = False,
    ):
        self.subscriber = Subscriber()
        self.subscriber.indexes[EAGLE_CONTROL] = Index(eagle_aware=False)
        transfer = None
        if offloading:
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
            num_blocks,
            transfer,
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=1024,
        )
        config.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.subscriber.endpoint,
        )
        if use_eagle:
            speculative_config = SpeculativeConfig(
                method="ngram", num_speculative_tokens=2
            )
            object.__setattr__(speculative_config, "method", "eagle")
            config.speculative_config = speculative_config
        kv_cache_config = make_kv_cache_config(kinds, BLOCK_SIZE, WINDOW, num_blocks)
        self.scheduler = make_scheduler(config, kv_cache_config)
        assert self.scheduler.use_eagle is use_eagle
        self.worker = None
        if offloading:
            self.worker = OffloadingConnector(
                config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
            )
            self.worker.connector_worker._register_handlers(
                {
                    name: torch.zeros(2, num_blocks, BLOCK_SIZE, 1, 1)
                    for group in kv_cache_config.kv_cache_groups
                    for name in group.layer_names
                },
                {},
            )
        self.next_id = 0
        self.records: list[tuple[int, dict]] = []  # (reported, predictions)
        self.published = 0  # batches the publisher numbered (0, 1, ...)
        publisher = self.scheduler.kv_event_publisher
        publish = publisher.publish

        def counted(batch) -> None:
            self.published += 1
            publish(batch)

        publisher.publish = counted
        # A PUB socket drops what it sends before its connection is up: empty
        # batches until the subscriber receives one.
        deadline = time.monotonic() + 30.0
        while self.subscriber.next_seq is None:
            assert time.monotonic() < deadline, "the subscriber receives nothing"
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            self.subscriber.drain(quiet_ms=50)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.subscriber.close()

    def drain(self) -> None:
        """Receive every batch published so far (the sequence numbers say
        which the subscriber has)."""
        deadline = time.monotonic() + 30.0
        while self.subscriber.next_seq != self.published:
            assert time.monotonic() < deadline, (
                f"received up to {self.subscriber.next_seq} of {self.published}"
            )
            self.subscriber.drain(quiet_ms=20)

    def step(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        connector_output = None
        if self.worker is not None:
            worker = self.worker
            worker.bind_connector_metadata(output.kv_connector_metadata)
            worker.start_load_kv(None)
            if output.total_num_scheduled_tokens:
                worker.wait_for_save()
            sending, recving = worker.get_finished(output.finished_req_ids)
            worker.clear_connector_metadata()
            connector_output = KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None
            )
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a chunk of the prompt
                continue
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            sampled.append([500 + (request.num_tokens + j) % 50 for j in drafts[:1]])
            sampled[-1].append(600 + request.num_tokens % 50)
        scheduler.update_from_output(
            output, model_runner_output(req_ids, sampled, connector_output)
        )
        if scheduler.use_eagle:
            drafted = [
                r
                for r, t in zip(req_ids, sampled, strict=True)
                if t and r in scheduler.requests
            ]
            scheduler.update_draft_token_ids(
                DraftTokenIds(drafted, [[700, 701]] * len(drafted))
            )

    def run(self, tokens: list[int], tier: bool = False) -> None:
        """Predict the request's cached tokens from the events so far, run it
        to its end, and keep (reported, predictions)."""
        self.drain()
        predictions = {
            key: (index.predict_tier(tokens) if tier else index.predict(tokens))
            for key, index in self.subscriber.indexes.items()
        }
        predictions["local"] = self.subscriber.indexes[True].predict(tokens)
        if tier:
            predictions[TIER_CONTROL] = self.subscriber.indexes[True].predict_tier(
                tokens, engine_rule=True
            )
        request = make_request(f"r{self.next_id}", tokens, BLOCK_SIZE, max_tokens=3)
        self.next_id += 1
        self.scheduler.add_request(request)
        for _ in range(200):
            self.step()
            if request.request_id not in self.scheduler.requests:
                break
        else:
            raise AssertionError(f"{request.request_id} did not finish")
        self.records.append((request.num_cached_tokens, predictions))

    def stream(self, seed: int, num_requests: int, tier: bool = False) -> None:
        rng = random.Random(seed)
        for i in range(num_requests):
            if tier and i % 6 == 5:
                # Empty the local prefix cache: the CPU tier serves. The
                # engine publishes it (AllBlocksCleared) with its next step.
                assert self.scheduler.reset_prefix_cache()
                self.step()
            prefix = PREFIXES[rng.randrange(len(PREFIXES))]
            prompt = prefix[: len(prefix) - rng.choice([0, 0, 1, 5, 16, 40])]
            prompt += [5000 + 100 * i + j for j in range(rng.choice([0, 1, 17, 40]))]
            self.run(prompt, tier)
        self.drain()

    def count(self, key) -> dict[str, int]:
        return {
            "requests": len(self.records),
            "hits": sum(reported > 0 for reported, _ in self.records),
            "mispredicted": sum(reported != p[key] for reported, p in self.records),
            "overpredicted": sum(reported < p[key] for reported, p in self.records),
            "overpredicted tokens": sum(
                max(0, p[key] - reported) for reported, p in self.records
            ),
            # hits the local prefix cache alone does not serve
            "tier hits": sum(reported > p["local"] for reported, p in self.records),
        }
