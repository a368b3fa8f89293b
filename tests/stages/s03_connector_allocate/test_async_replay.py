"""Stage 03: the asynchronous scheduling model replayed through the AsyncScheduler.

``spec/AsyncSched.tla`` models one request under asynchronous scheduling:
steps in flight in a batch queue, their outputs processed later, and the
in-flight fence of ``remove_skipped_blocks`` (patch 4: the blocks of the
sliding window group that leave the window are those skipped by
``num_computed_tokens - num_in_flight_tokens``, not by
``num_computed_tokens``, so no step in flight reads a freed slot). This file
follows its behaviours (``fixtures/async-replay/trace-*.json``, simulated from
``fixtures/replay-async.cfg``; or every ``trace-*.json`` of the directory
named by ``HMASTACK_ASYNC_REPLAY_TRACES``) through the real
``vllm.v1.core.sched.async_scheduler.AsyncScheduler``: one full attention
group and one sliding window group of W tokens, block size B, prefix caching
on.

The harness drives what the model chooses and a scheduler leaves to the
engine: when ``schedule()`` is called (the model's ``ScheduleWaiting`` or
``ScheduleRunning``: the request's step is appended to the queue) and when the
oldest step's output is processed (``UpdateFromOutput``: ``update_from_output``
with the token the step samples, or none for a prefill chunk). The token
budget is the model's ``Chunk``.

After every step the scheduler is compared with the model: the request's
status, ``num_tokens``, ``num_computed_tokens``, ``num_output_placeholders``,
the steps in flight (their first token and size), and the leading null
entries of its sliding window table (the model's ``skip``: null padding and
the slots ``remove_skipped_blocks`` freed). A mismatch fails with the trace,
the step and both states.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

import pytest
from kvtest import make_cpu_vllm_config, make_kv_cache_groups
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

FIXTURES = Path(__file__).parent / "fixtures" / "async-replay"
NUM_BLOCKS = 32  # the null block included: memory is never short
REQ = "r"
# A token that is neither EOS nor a prompt token.
SAMPLED = 7


def trace_files() -> list[Path]:
    folder = Path(os.environ.get("HMASTACK_ASYNC_REPLAY_TRACES", FIXTURES))
    return sorted(folder.glob("trace-*.json"))


STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.PREEMPTED: "waiting",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "loading",
    RequestStatus.RUNNING: "running",
}


class Mismatch(AssertionError):
    pass


class AsyncReplay:
    """An AsyncScheduler with one request, driven by a model behaviour."""

    def __init__(self, constants: dict):
        self.c = constants
        b, w = constants["B"], constants["W"]
        assert constants["Ext"] == 0 and constants["MaxPreempts"] == 0, (
            "the replay drives no connector and no preemption"
        )
        vllm_config = make_cpu_vllm_config(
            b,
            NUM_BLOCKS,
            None,
            max_num_seqs=1,
            max_num_batched_tokens=constants["Chunk"],
            max_model_len=constants["MaxLen"] + 1,
        )
        vllm_config.scheduler_config.async_scheduling = True
        self.sched = AsyncScheduler(
            vllm_config=vllm_config,
            kv_cache_config=KVCacheConfig(
                num_blocks=NUM_BLOCKS,
                kv_cache_tensors=[],
                kv_cache_groups=make_kv_cache_groups(["full", "sliding_window"], b, w),
            ),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=b,
            log_stats=False,
        )
        self.request = Request(
            request_id=REQ,
            prompt_token_ids=[100 + i for i in range(constants["PromptLen"])],
            sampling_params=SamplingParams(
                max_tokens=constants["MaxLen"] - constants["PromptLen"],
                ignore_eos=True,
            ),
            pooling_params=None,
            eos_token_id=None,
            block_hasher=get_request_block_hasher(b, sha256),
        )
        self.sched.add_request(self.request)
        # The steps in flight, oldest first: (SchedulerOutput, first token,
        # tokens scheduled).
        self.queue: deque[tuple[SchedulerOutput, int, int]] = deque()
        # The steps in flight that sample a token (ids of their outputs).
        self.sampling: set[int] = set()
        self.done = False

    def schedule(self) -> None:
        before = self.request.num_computed_tokens
        out = self.sched.schedule()
        n = out.num_scheduled_tokens.get(REQ, 0)
        if n == 0:
            raise Mismatch("the model schedules a step, the scheduler none")
        self.queue.append((out, before, n))

    def update_oldest(self) -> None:
        """The oldest step's output: the token it samples (when it reached the
        request's last token), or none for a prefill chunk."""
        out, _, _ = self.queue.popleft()
        tokens = [SAMPLED] if id(out) in self.sampling else []
        self.sampling.discard(id(out))
        runner = ModelRunnerOutput(
            req_ids=[REQ],
            req_id_to_index={REQ: 0},
            sampled_token_ids=[tokens],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        self.sched.update_from_output(out, runner)
        if self.request.is_finished():
            self.done = True

    def state(self) -> dict:
        """The model's view of the scheduler."""
        r = self.request
        manager = self.sched.kv_cache_manager
        status = "done" if self.done else STATUS[r.status]
        skip = 0
        if not self.done:
            swa = manager.coordinator.single_type_managers[1].req_to_blocks.get(REQ, [])
            for block in swa:
                if not block.is_null:
                    break
                skip += 1
        return {
            "status": status,
            "len": r.num_tokens,
            "computed": 0 if self.done else r.num_computed_tokens,
            "ph": 0 if self.done else r.num_output_placeholders,
            "queue": [(first, n) for _, first, n in self.queue],
            "skip": skip,
        }


def model_view(st: dict) -> dict:
    return {
        "status": st["status"],
        "len": st["len"],
        "computed": st["computed"],
        "ph": st["ph"],
        "queue": [(s["from"], s["n"]) for s in st["queue"]],
        "skip": st["skip"],
    }


def replay(doc: dict) -> int:
    """Replays one behaviour; returns the steps compared."""
    init_none_hash(sha256)
    states = doc["states"]
    rp = AsyncReplay(doc["constants"])
    for k in range(1, len(states)):
        before, after = states[k - 1], states[k]
        if len(after["queue"]) > len(before["queue"]):
            step = after["queue"][-1]
            rp.schedule()
            if step["sample"]:
                rp.sampling.add(id(rp.queue[-1][0]))
        elif len(after["queue"]) < len(before["queue"]):
            rp.update_oldest()
        else:
            raise Mismatch(f"trace {doc.get('index')} step {k}: an action not replayed")
        want, got = model_view(after), rp.state()
        if want != got:
            diff = {key: (want[key], got[key]) for key in want if want[key] != got[key]}
            raise Mismatch(
                f"{doc['model']} trace {doc.get('index')} step {k}: model != "
                f"scheduler {diff}\nmodel {want}\nscheduler {got}"
            )
    return len(states) - 1


def test_async_replay_fixtures_exist():
    files = trace_files()
    assert files, f"no trace-*.json under {FIXTURES}"
    # The fixtures exercise what the fence guards: a slide of the window
    # while a step is in flight.
    slides = 0
    for path in files:
        states = json.loads(path.read_text())["states"]
        slides += sum(
            1
            for a, b in zip(states, states[1:], strict=False)
            if b["skip"] > a["skip"] and a["queue"] and a["status"] == "running"
        )
    assert slides > 0, "no behaviour slides the window with a step in flight"


@pytest.mark.parametrize("path", trace_files(), ids=lambda p: p.stem)
def test_async_replay(path: Path):
    doc = json.loads(path.read_text())
    assert replay(doc) > 0
