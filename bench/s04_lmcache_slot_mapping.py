"""Scheduler-side cost of LMCache's vLLM v1 adapter per step
([lmcache 04.5 vLLM v1 adapter: per-group]).

One running request of 8192 tokens, 6 KV cache groups (5 sliding W=512, 1
full), blocks of 16, chunks of 256: drop_skipped_blocks + from_request_tracker
(the slot mapping of all tokens, the store rule). ``--all`` resets the saved
tokens to 0 (every chunk looked at); the default stores one new chunk, as a
running request does. A measurement to compare two LMCache trees in one run,
not a test:

    PYTHONPATH=<lmcache tree>:build/vllm build/env/bin/python \
        bench/s04_lmcache_slot_mapping.py <label> [--all]
"""

import sys
import timeit

from lmcache.integration.vllm import vllm_v1_adapter as a
from lmcache.integration.vllm.utils import VLLMKVCacheGroup

B, N, CH = 16, 8192, 256
groups = [VLLMKVCacheGroup((f"s{i}",), B, sliding_window=512) for i in range(5)]
groups.append(VLLMKVCacheGroup(("f",), B))
nb = N // B
tables = [[0] * (nb - 33) + list(range(1000 * g + 1, 1000 * g + 34)) for g in range(5)]
tables.append(list(range(10000, 10000 + nb)))
t = a.RequestTracker(
    req_id="r",
    prompt_len=N,
    token_ids=list(range(N)),
    allocated_block_ids=[list(x) for x in tables],
    num_saved_tokens=0,
)


def step():
    # A running request stores one new chunk; --all: every chunk.
    t.num_saved_tokens = 0 if "--all" in sys.argv else N - CH
    t.drop_skipped_blocks(groups, N - 1)
    m = a.ReqMeta.from_request_tracker(t, groups, CH)
    assert m is not None


n = 300
best = min(timeit.repeat(step, number=n, repeat=5)) / n * 1e3
print(f"{sys.argv[1]}: {best:.3f} ms per step (best of 5 x {n})")
