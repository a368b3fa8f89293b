"""Stage 03: behaviours of the model (Series) replayed with vLLM's objects.

The fixtures under ``fixtures/replay/`` (or the directory named by
``HMASTACK_REPLAY_TRACES``, as ``hmastack conform`` does) are behaviours of
``fixtures/replay-small.cfg`` (``Policy = "SeriesAllocOnly"``: stage 03 as it is)
written by
``hmastack spec traces patches/03-connector-allocate/tests/fixtures/replay-small.cfg
-n 40 --depth 60 --out patches/03-connector-allocate/tests/fixtures/replay``
(TLC -simulate, seed of spec/tlc.toml), committed so that this test needs no
Java.

The driver stands for the scheduler and the connector and follows each step's
``event`` with the patched ``KVCacheManager`` (full attention + sliding window,
block size B, one pool of N blocks). Token counts (hit, external, new, draft,
accepted tokens) come from the model; the blocks come from vLLM. A bijection
model block id <-> real block id is built as blocks are handed out (position by
position in the tables) and after every step the abstraction of the real state
is compared with the model state:

* every request's per-group table (null entries and mapped real blocks),
* ``ref_cnt`` of every model block through the bijection (0 if unmapped),
* the free queue size, the number of prefix-cached blocks,
* the prefix cache hit found by ``get_computed_blocks`` (``hit`` of the event),
* vLLM's own admission count (``get_num_blocks_to_allocate``) with the model's
  prediction, and a refusal (``Refused``: ``allocate_slots`` returns None)
  with a refusal,
* after a load failure, ``can_recompute_from`` with the model's choice to
  resume in place or start over.

A mismatch fails with the trace, the step and both states. The model may evict
any cached free block where vLLM evicts the LRU head, and hit any block of a
prefix-cache key where vLLM takes the first: both choices are steered
(``kvtest.steer_free_queue``, ``kvtest.steer_hits``); when the evicted blocks
still differ (a block freed in the same step), the rest of the behaviour is not
comparable and the replay of that trace stops there (counted, not a failure).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hmastack_testkit import traces
from hmastack_testkit.kvtest import (
    REPLAY_POLICIES,
    AdmissionSpy,
    SkippedBlocksSpy,
    bind_new_blocks,
    compare_pool,
    compare_table,
    make_request,
    model_hit_blocks,
    steer_free_queue,
    steer_hits,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

# ``hmastack conform`` replays fresh TLC behaviours instead of the fixtures.
FIXTURES = Path(
    os.environ.get("HMASTACK_REPLAY_TRACES")
    or Path(__file__).parent / "fixtures" / "replay"
)
TRACES = sorted(FIXTURES.glob("trace-*.json"))
GROUPS = ("full", "swa")

# Events that touch no block state of the KVCacheManager (the scheduler keeps
# the blocks): replayed as no-ops, the comparison still runs after them.
NO_OP = {"AbortDelayed", "FinishDelayed"}
# Event kinds not mapped: a trace stops being replayed at the first one.
SKIPPED_EVENTS: set[str] = set()


class Mismatch(AssertionError):
    pass


class Diverged(Exception):
    """The model chose another eviction than vLLM's LRU: stop this trace."""


@dataclass
class Replay:
    constants: dict
    manager: KVCacheManager = field(init=False)
    requests: dict = field(default_factory=dict)
    m2r: dict = field(default_factory=dict)  # model block id -> real block id
    r2m: dict = field(default_factory=dict)
    steps: int = 0
    # Reorder vLLM's free queue to the model's eviction choice
    # (kvtest.steer_free_queue).
    steer: bool = True
    # The model's saves (real block ids): a connector's hook tells the
    # KVCacheManager which freed blocks a store still reads (`held`).
    saves: dict = field(default_factory=dict)

    def __post_init__(self):
        c = self.constants
        # A connector that uses HMA, with two KV cache groups (the model's
        # ConnectorHMA, TRUE where a behaviour does not name it).
        assert c.get("ConnectorHMA", True), "the replay drives two KV cache groups"
        # A sliding window beside full attention (the model's Kind, "swa"
        # where a behaviour does not name it): stage 03 has no Mamba group.
        assert c.get("Kind", "swa") == "swa", "the replay drives a sliding window"
        self.B, self.N = c["B"], c["N"]
        specs = [
            KVCacheGroupSpec(["full"], FullAttentionSpec(self.B, 1, 1, torch.float32)),
            KVCacheGroupSpec(
                ["swa"],
                SlidingWindowSpec(self.B, 1, 1, torch.float32, sliding_window=c["W"]),
            ),
        ]
        self.manager = KVCacheManager(
            KVCacheConfig(
                num_blocks=self.N + 1, kv_cache_tensors=[], kv_cache_groups=specs
            ),
            max_model_len=1 << 10,
            enable_caching=True,
            hash_block_size=self.B,
            hold_freed_blocks=lambda r, ids: self.saves.get(r, set()) & set(ids),
        )
        self.pool = self.manager.block_pool
        self.skipped_spy = SkippedBlocksSpy(self.manager.coordinator)
        self.admission = AdmissionSpy(self.manager.coordinator)
        for k, r in enumerate(c["Req"]):
            base = 1000 * (k + 1)
            shared = list(range(c["Shared"]))
            own = [base + i for i in range(c["Shared"], c["PromptLen"])]
            self.requests[r] = make_request(r, shared + own, self.B)

    # ---- real state ----
    def real_tables(self, r: str) -> dict[str, list[int]]:
        tables = self.manager.coordinator.get_blocks(r)
        return {
            g: [b.block_id for b in t] for g, t in zip(GROUPS, tables, strict=False)
        }

    def cached_real(self) -> set[int]:
        return {
            b.block_id
            for b in self.pool.blocks
            if not b.is_null and b.block_hash is not None
        }

    # ---- steps ----
    def steer_eviction(self, ev: dict) -> None:
        """The model's choice of new blocks at the head of vLLM's free queue."""
        order = [m for g in GROUPS for m in ev["blocks"][g]]
        steer_free_queue(self.pool, self.m2r, self.r2m, order)

    def call_allocate(self, before: dict, after: dict, ev: dict):
        """``allocate_slots`` as the scheduler calls it for the model's step
        (the hit checked against the model's); returns what it returns."""
        r, a = ev["req"], ev["args"]
        request = self.requests[r]
        fresh = before["status"][r] == "waiting" and before["computed"][r] == 0
        self.admission.counts.clear()
        if fresh:
            request.num_computed_tokens = 0
            if after is not None:
                # The model's hit blocks (any block of their key) first.
                steer_hits(
                    self.pool,
                    model_hit_blocks(self.m2r, after["table"][r], a["hitBlocks"]),
                )
            hits, num_hit = self.manager.get_computed_blocks(request)
            if num_hit != a["hitBlocks"] * self.B:
                raise Mismatch(
                    f"prefix cache hit: vLLM {num_hit} tokens, model "
                    f"{a['hitBlocks']} blocks"
                )
            new = self.manager.allocate_slots(
                request,
                a["newTokens"],
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hits,
                num_lookahead_tokens=a["draftTokens"],
                num_external_computed_tokens=a["extTokens"],
                delay_cache_blocks=a["async"],
            )
        else:
            request.num_computed_tokens = before["computed"][r]
            new = self.manager.allocate_slots(
                request, a["newTokens"], num_lookahead_tokens=a["draftTokens"]
            )
        if self.admission.counts[-1:] != [a["predictedBlocks"]]:
            raise Mismatch(
                f"get_num_blocks_to_allocate: vLLM {self.admission.counts}, "
                f"model {a['predictedBlocks']}"
            )
        return new

    def refused(self, before: dict, after: dict, ev: dict) -> None:
        """The model refuses a waiting request: so must allocate_slots."""
        r = ev["req"]
        if self.call_allocate(before, None, ev) is not None:
            raise Mismatch(
                f"allocate_slots scheduled {r} although the model refuses it "
                f"({ev['args']['predictedBlocks']} blocks, "
                f"{ev['args']['freeBlocks']} free)"
            )
        self.requests[r].num_computed_tokens = before["computed"][r]

    def allocate(self, before: dict, after: dict, ev: dict) -> None:
        r = ev["req"]
        fresh = before["status"][r] == "waiting" and before["computed"][r] == 0
        self.skipped_spy.calls.clear()
        if self.steer:
            if not fresh:
                # allocate_slots frees the skipped blocks before it allocates;
                # do it first so the freed blocks can be steered too (a second
                # call finds them null and frees nothing). The spy checks
                # below that allocate_slots still makes that call.
                # As allocate_slots: the blocks a store still reads are held.
                freed = self.skipped_spy.free_now(r, before["computed"][r])
                if freed:
                    self.manager._hold_blocks(r, freed)
            self.steer_eviction(ev)
        cached_before = self.cached_real()
        model_new = set(ev["blocks"]["full"]) | set(ev["blocks"]["swa"])
        model_evicted = {m for m in model_new if before["hash"][m - 1]}
        new = self.call_allocate(before, after, ev)
        if new is None:
            raise Mismatch(
                f"allocate_slots refused ({ev['args']['predictedBlocks']} predicted)"
            )
        if not fresh and (r, before["computed"][r]) not in self.skipped_spy.calls:
            raise Mismatch(
                f"allocate_slots did not free the skipped blocks of {r} for "
                f"{before['computed'][r]} computed tokens "
                f"(remove_skipped_blocks calls: {self.skipped_spy.calls})"
            )
        new_ids = new.get_block_ids()
        # Eviction: the model's evicted blocks (cached before, allocated now)
        # must be vLLM's evicted blocks, through the bijection.
        real_evicted = {x for ids in new_ids for x in ids} & cached_before
        if {self.m2r.get(m) for m in model_evicted} != real_evicted:
            raise Diverged(
                f"model evicts {sorted(model_evicted)}, vLLM evicts "
                f"{sorted(self.r2m.get(x, x) for x in real_evicted)} (as model ids)"
            )
        bind_new_blocks(
            self.m2r, self.r2m, after["table"][r], self.real_tables(r), ev["blocks"]
        )
        self.requests[r].num_computed_tokens = after["computed"][r]

    def execute(self, before: dict, after: dict, ev: dict) -> None:
        r = ev["req"]
        request = self.requests[r]
        grow = after["len"][r] - before["len"][r]
        for _ in range(grow):
            request.append_output_token_ids(7000 + request.num_tokens)
        request.num_computed_tokens = after["computed"][r]
        if ev["act"] == "Finish":
            self.manager.free(request)

    def finish_load(self, before: dict, after: dict, ev: dict) -> None:
        r = ev["req"]
        request = self.requests[r]
        if ev["act"] == "FinishLoadFree" or after["status"][r] == "done":
            self.manager.free(request)
            return
        if before["status"][r] == "finishing":
            return
        # As Scheduler._update_waiting_for_remote_kv: the request resumes after
        # its hit + external tokens (the scheduler replay checks that count),
        # or after what a load failure left valid; with none it starts over.
        c = after["computed"][r]
        if c == 0:
            self.manager.free(request)
        else:
            self.manager.cache_blocks(request, c)
        request.num_computed_tokens = c

    def check_recompute(self, r: str, at: int, computed: int) -> None:
        """The model resumes in place from slot ``at`` (1-based) or starts over:
        KVCacheManager.can_recompute_from must agree."""
        t = (at - 1) * self.B
        if t == 0:
            return
        can = self.manager.can_recompute_from(r, t)
        if can != (computed == t):
            raise Mismatch(
                f"can_recompute_from({r}, {t}) = {can}, model resumes {r} at "
                f"{computed} tokens"
            )

    def load_failed(self, before: dict, after: dict, ev: dict) -> None:
        """_handle_invalid_blocks + _update_waiting_for_remote_kv of an async
        load that failed from slot ``at`` on."""
        r, a = ev["req"], ev["args"]
        if before["status"][r] == "finishing":
            if after["status"][r] == "done":
                self.manager.free(self.requests[r])
            return
        self.check_recompute(r, a["atSlot"], a["computedTokens"])
        if a["computedTokens"] > 0:
            self.manager.uncache_blocks(r, a["computedTokens"])
        self.finish_load(before, after, ev)

    def sync_load_failed(self, before: dict, after: dict, ev: dict) -> None:
        """_handle_invalid_blocks for a synchronous load: the affected requests
        resume from the model's num_computed_tokens; the restarted ones have
        their invalid blocks evicted from the prefix cache and are freed."""
        r, a = ev["req"], ev["args"]
        if (
            r in a["affected"]
            and r not in a["restart"]
            and a["computedTokens"] != before["computed"][r]
        ):
            self.check_recompute(r, a["atSlot"], a["computedTokens"])
        # Patch [00c.1 All sharers of a failed KV block]: the blocks from each
        # affected request's first invalid block on leave the prefix cache
        # (evict_blocks), whether it resumes in place or starts over.
        unhashed = {
            self.m2r[m]
            for m in range(1, self.N + 1)
            if before["hash"][m - 1] and not after["hash"][m - 1] and m in self.m2r
        }
        self.manager.evict_blocks(unhashed)
        for q in a["restart"]:
            if self.manager.can_recompute_from(q, 0):
                raise Mismatch(f"{q} starts over, but can_recompute_from({q}, 0)")
            self.manager.free(self.requests[q])
        for q in a["affected"]:
            self.requests[q].num_computed_tokens = after["computed"][q]
            if q not in a["restart"]:
                # Patch [00c.1 All sharers of a failed KV block]: the blocks
                # it computes again are cached again.
                self.manager.uncache_blocks(q, after["computed"][q])

    def free_and_restart(self, before: dict, after: dict, ev: dict) -> None:
        r = ev["req"]
        self.manager.free(self.requests[r])
        self.requests[r].num_computed_tokens = after["computed"][r]

    def free_waiting(self, before: dict, after: dict, ev: dict) -> None:
        """Scheduler._free_blocks_of_waiting_requests: the waiting requests
        back from async loads give their blocks up and start over."""
        for q in ev["args"]["freed"]:
            self.manager.free(self.requests[q])
            self.requests[q].num_computed_tokens = after["computed"][q]

    def save_done(self, before: dict, after: dict, ev: dict) -> None:
        """finished_sending: held blocks are freed; a finished request's
        delayed free happens now."""
        r = ev["req"]
        self.saves.pop(r, None)
        self.manager.free_held_blocks(r)
        if after["status"][r] == "done":
            self.manager.free(self.requests[r])

    def mirror_saves(self, state: dict) -> None:
        """The stores that outlive the step (SaveMode "async"); a save inside
        the step is over when the step returns and holds nothing."""
        if self.constants["SaveMode"] != "async":
            return
        self.saves = {
            r: {self.m2r[m] for _g, _i, m in blocks if m in self.m2r}
            for r, blocks in state["saves"].items()
            if blocks
        }

    def step(self, before: dict, after: dict) -> None:
        ev = after["event"]
        act = ev["act"]
        # A store starts when the step runs (Execute): the hook knows it then.
        self.mirror_saves(
            after if act in ("Execute", "Finish", "FinishDelayed") else before
        )
        if act == "AllocateSlots":
            self.allocate(before, after, ev)
        elif act in ("Execute", "Finish", "FinishDelayed"):
            self.execute(before, after, ev)
        elif act in ("FinishLoad", "FinishLoadFree"):
            self.finish_load(before, after, ev)
        elif act == "LoadFailed":
            self.load_failed(before, after, ev)
        elif act == "SyncLoadFailed":
            self.sync_load_failed(before, after, ev)
        elif act == "Refused":
            self.refused(before, after, ev)
        elif act in ("Preempt", "Abort"):
            self.free_and_restart(before, after, ev)
        elif act == "FreeWaiting":
            self.free_waiting(before, after, ev)
        elif act == "SaveDone":
            self.save_done(before, after, ev)
        elif act in NO_OP:
            pass
        else:
            raise KeyError(act)

    # ---- abstraction ----
    def compare(self, state: dict) -> list[str]:
        problems = []
        for r in self.requests:
            problems += compare_table(
                r, self.real_tables(r), state["table"][r], self.r2m
            )
        problems += compare_pool(self.pool, self.m2r, state, self.N)
        for r in self.requests:
            held = sorted(
                self.r2m.get(b.block_id, f"?{b.block_id}")
                for b in self.manager.held_blocks.get(r, [])
            )
            if held != sorted(state["held"][r]):
                problems.append(
                    f"held {r}: model {sorted(state['held'][r])}, vLLM {held}"
                )
        model_cached = {m for m, h in enumerate(state["hash"], start=1) if h}
        real_cached = {self.r2m.get(x, f"?{x}") for x in self.cached_real()}
        if real_cached != model_cached:
            problems.append(
                f"cached blocks: model {sorted(model_cached)}, vLLM "
                f"{sorted(real_cached, key=str)} (as model ids)"
            )
        return problems

    def real_state(self) -> dict:
        return {
            "tables": {r: self.real_tables(r) for r in self.requests},
            "ref": {b.block_id: b.ref_cnt for b in self.pool.blocks[1:]},
            "free": [
                b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()
            ],
            "cached": sorted(self.cached_real()),
            "model->vLLM": dict(sorted(self.m2r.items())),
        }


def model_state(state: dict) -> dict:
    keys = (
        "event",
        "table",
        "ref",
        "freeQ",
        "hash",
        "computed",
        "len",
        "status",
        "saves",
        "held",
    )
    return {k: state[k] for k in keys}


STATS = {
    "acts": {},
    "pc_only": 0,
    "traces": 0,
    "steps": 0,
    "diverged": [],
    "skipped": [],
}


def replay(path: Path) -> None:
    doc = traces.read(path)
    assert doc.constants["Policy"] in REPLAY_POLICIES, "replay the code as it is"
    rp = Replay(doc.constants)
    states = doc.states
    STATS["traces"] += 1
    for k in range(1, len(states)):
        before, after = states[k - 1], states[k]
        act = after["event"]["act"]
        if all(before[v] == after[v] for v in after if v != "pc"):
            # A process left its loop (pc only): no step of the allocator.
            STATS["pc_only"] += 1
            continue
        if act in SKIPPED_EVENTS:
            STATS["skipped"].append((path.name, k, act))
            return
        try:
            rp.step(before, after)
        except Diverged as exc:
            STATS["diverged"].append((path.name, k, str(exc)))
            return
        except Mismatch as exc:
            problems = [str(exc)]
        else:
            problems = rp.compare(after)
        STATS["steps"] += 1
        STATS["acts"][act] = STATS["acts"].get(act, 0) + 1
        if problems:
            raise Mismatch(
                f"{path.name} step {k} ({after['event']}):\n  "
                + "\n  ".join(problems)
                + f"\nmodel before: {json.dumps(model_state(before))}"
                + f"\nmodel after:  {json.dumps(model_state(after))}"
                + f"\nvLLM after:   {json.dumps(rp.real_state())}"
            )


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_replay(path):
    replay(path)


def test_fixtures_present_and_replayed():
    """Run last in file order: the fixtures exist and, when every trace was
    replayed in this run, at least nine steps in ten were compared or were a
    process leaving its loop, which moves no block (the others: the rest of a
    trace stopped at an event the replay does not map or at the model's other
    eviction choice)."""
    # the committed fixtures are 20 or more; `hmastack conform --traces N`
    # simulates N fresh ones
    fresh = os.environ.get("HMASTACK_REPLAY_TRACES") is not None
    assert len(TRACES) >= (1 if fresh else 20), FIXTURES
    index = traces.read_index(FIXTURES)
    assert len(index.traces) == len(TRACES)
    if STATS["traces"] == len(TRACES):
        total = sum(len(traces.read(p).states) - 1 for p in TRACES)
        assert STATS["steps"] + STATS["pc_only"] >= 0.9 * total, (STATS, total)
    print(f"\nreplay: {STATS['traces']} traces, {STATS['steps']} steps compared")
    print(f"pc-only steps (no event): {STATS['pc_only']}")
    print(f"diverged (eviction choice): {len(STATS['diverged'])}")
    for where in STATS["diverged"]:
        print(f"  {where}")
    print(f"skipped events: {STATS['skipped']}")
    print(f"compared steps by action: {dict(sorted(STATS['acts'].items()))}")
    if os.environ.get("HMASTACK_CONFORM_SUMMARY"):
        summary = {
            "traces": STATS["traces"],
            "steps_compared": STATS["steps"],
            "diverged_eviction_choice": len(STATS["diverged"]),
            "acts": dict(STATS["acts"]),
            "stopped_unmapped_event": len(STATS["skipped"]),
        }
        Path(os.environ["HMASTACK_CONFORM_SUMMARY"]).write_text(json.dumps(summary))
