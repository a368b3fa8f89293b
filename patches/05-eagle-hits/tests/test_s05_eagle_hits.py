"""Stage 05: prefix cache hits with eagle, checked on the real `Scheduler`.

A hypothesis `RuleBasedStateMachine` drives vLLM's `Scheduler` with eagle on
(lookahead slots, draft tokens) and a hybrid KV cache (Gemma-3-like: 5 sliding
window groups + 1 full attention group, or gpt-oss-like: one of each), a small
pool (eviction, preemption), and prompts built from a few shared prefixes, so
that requests hit each other's blocks: identical prompts (fully cached), longer
and shorter ones, and blocks evicted from some groups by the pool's LRU.

Property (the model's `LongestServableHit`, see the stage README): every
prefix cache lookup the scheduler makes (`KVCacheManager.get_computed_blocks`)
returns the longest hit that every KV cache group serves, by the rule: L a
multiple of the block size B, L + B at most the request's length - 1, and each
group holds as prefix cache hits its blocks for L (full attention: 0 ~ L/B - 1;
sliding window W: those of the window of token L) and block L/B, which eagle
computes again. The oracle tries every L against the block pool's cache.

CI runs a fixed, derandomized set (60 examples of at most 40 rules); the
examples must make non-zero hits (asserted). `HMASTACK_RANDOM_EXAMPLES=N` runs N
random examples instead.
"""

from __future__ import annotations

from collections import Counter

from hmastack_testkit.kvtest import (
    example_settings,
    make_cpu_vllm_config,
    make_kv_cache_config,
    make_scheduler,
)
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

BLOCK_SIZE = 16
EOS = 2
NUM_SPEC_TOKENS = 2
LAYOUTS = {
    "gemma3_like": ["sliding_window"] * 5 + ["full"],
    "gpt_oss_like": ["full", "sliding_window"],
}
# Shared prompt prefixes (tokens): a request takes one, possibly cut, plus its
# own tokens (none: the same prompt as an earlier request).
PREFIXES = [[1000 + 7 * i + p for i in range(n)] for p, n in enumerate((70, 165, 300))]

SETTINGS = example_settings(60, steps=40)

# What the examples exercised, over the whole run.
COUNTS: Counter[str] = Counter()


def longest_servable_hit(manager, request: Request, kinds: list[str], window: int):
    """The rule, tried length by length against the block pool's cache."""
    pool = manager.block_pool
    hashes = request.block_hashes
    max_len = request.num_tokens - 1

    def cached(group: int, block: int) -> bool:
        return (block + 1) * BLOCK_SIZE <= max_len and (
            pool.get_cached_block(hashes[block], [group]) is not None
        )

    def serves(hit: int) -> bool:
        for group, kind in enumerate(kinds):
            first = 0 if kind == "full" else max(0, hit - window + 1) // BLOCK_SIZE
            blocks = range(first, hit // BLOCK_SIZE + 1)  # + the block after it
            if not all(cached(group, b) for b in blocks):
                return False
        return True

    hits = [h for h in range(BLOCK_SIZE, max_len + 1, BLOCK_SIZE) if serves(h)]
    return max([0, *hits])


class Harness:
    def __init__(self, layout: str, window: int, num_blocks: int):
        self.kinds = LAYOUTS[layout]
        self.window = window
        config = make_cpu_vllm_config(
            BLOCK_SIZE,
            num_blocks,
            None,
            max_num_seqs=4,
            max_num_batched_tokens=128,
            max_model_len=1024,
        )
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=NUM_SPEC_TOKENS
        )
        # The scheduler only asks use_eagle(); an eagle draft model cannot be
        # built on CPU.
        object.__setattr__(speculative_config, "method", "eagle")
        config.speculative_config = speculative_config
        self.scheduler = make_scheduler(
            config, make_kv_cache_config(self.kinds, BLOCK_SIZE, window, num_blocks)
        )
        assert self.scheduler.use_eagle
        self.manager = self.scheduler.kv_cache_manager
        self.lookups: list[tuple[str, int, int]] = []  # (req, hit, rule)
        self.next_id = 0
        get_computed_blocks = self.manager.get_computed_blocks

        def checked(request):
            want = longest_servable_hit(self.manager, request, self.kinds, window)
            blocks, hit = get_computed_blocks(request)
            self.lookups.append((request.request_id, hit, want))
            return blocks, hit

        self.manager.get_computed_blocks = checked

    def add_request(self, prefix: int, cut: int, num_own: int, max_tokens: int):
        base = PREFIXES[prefix]
        prompt = base[: max(1, len(base) - cut)]
        prompt += [5000 + 100 * self.next_id + i for i in range(num_own)]
        request = Request(
            request_id=f"r{self.next_id}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            eos_token_id=EOS,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.next_id += 1
        self.scheduler.add_request(request)

    def step(self, accept: int) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a chunk of the prompt
                continue
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            n = 1 + min(accept, len(drafts))
            sampled.append([500 + (request.num_tokens + j) % 50 for j in range(n)])
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
        drafted = [
            r
            for r, t in zip(req_ids, sampled, strict=True)
            if t and r in scheduler.requests
        ]
        scheduler.update_draft_token_ids(
            DraftTokenIds(drafted, [[600, 601]] * len(drafted))
        )

    def abort(self, pick: int) -> None:
        live = sorted(
            r for r, q in self.scheduler.requests.items() if not q.is_finished()
        )
        if live:
            self.scheduler.finish_requests(
                live[pick % len(live)], RequestStatus.FINISHED_ABORTED
            )

    def check_lookups(self) -> None:
        for req_id, hit, want in self.lookups:
            assert hit == want, f"LongestServableHit: {req_id} hit {hit}, rule {want}"
            COUNTS["lookups"] += 1
            COUNTS["non-zero hits"] += hit > 0
        self.lookups.clear()


class EagleHitsMachine(RuleBasedStateMachine):
    harness: Harness

    @initialize(
        layout=st.sampled_from(sorted(LAYOUTS)),
        window=st.sampled_from([32, 64]),
        num_blocks=st.integers(40, 120),
    )
    def start(self, layout, window, num_blocks):
        self.harness = Harness(layout, window, num_blocks)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        cut=st.sampled_from([0, 0, 0, 1, 5, 16, 40]),
        num_own=st.sampled_from([0, 0, 1, 17, 40]),
        max_tokens=st.integers(1, 6),
    )
    def add_request(self, prefix, cut, num_own, max_tokens):
        if len(self.harness.scheduler.requests) < 6:
            self.harness.add_request(prefix, cut, num_own, max_tokens)

    @rule(num_steps=st.integers(1, 5), accept=st.integers(0, 2))
    def steps(self, num_steps, accept):
        for _ in range(num_steps):
            self.harness.step(accept)
            self.harness.check_lookups()

    @rule(pick=st.integers(0, 5))
    def abort(self, pick):
        self.harness.abort(pick)

    @invariant()
    def longest_servable_hit(self):
        self.harness.check_lookups()


EagleHitsMachine.TestCase.settings = SETTINGS
test_eagle_hits_machine = EagleHitsMachine.TestCase


def test_examples_make_non_zero_hits():
    """Runs after the machine (file order): the examples looked up hits and
    many of them were non-zero (a machine whose hits are all 0 checks little)."""
    if not COUNTS["lookups"]:
        test_eagle_hits_machine("runTest").runTest()
    print(dict(COUNTS))  # with -s: what the examples exercised
    assert COUNTS["lookups"] >= 100, COUNTS
    assert COUNTS["non-zero hits"] >= COUNTS["lookups"] // 4, COUNTS
