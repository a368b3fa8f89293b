"""The scenarios: what one engine runs, with and without a connector.

Each scenario is a function ``(session, connector) -> list[RequestRecord]``.
With a connector it first stores prefixes (requests with ``load: none``), resets
the local prefix cache, then sends requests whose prefix the connector holds,
each with the cached-token count the engine must report. Without a connector
(the reference: no connector, no prefix caching) the same requests run and every
token is computed. The host compares the two runs request by request.

Sizes: block size B = 16 tokens, window W = 32 tokens (``models``).
The shared prefix ``P`` is 256 tokens (16 blocks).

Importable without vLLM (the host lists the names).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hmastack_testkit.e2e.models import BLOCK_SIZE

if TYPE_CHECKING:
    from hmastack_testkit.e2e.engine import Observation, RequestRecord, Session

B = BLOCK_SIZE
SCENARIOS: dict[str, Callable] = {}


def scenario(fn: Callable) -> Callable:
    SCENARIOS[fn.__name__.replace("_", "-")] = fn
    return fn


def _p(seed: int, n: int) -> list[int]:
    from hmastack_testkit.e2e.engine import prompt

    return prompt(seed, n)


PREFIX = 256


def _prefix(n: int = PREFIX) -> list[int]:
    return _p(100, n)


def _store(session: Session, requests, connector: bool) -> list[RequestRecord]:
    """Run ``requests`` (key, tokens) so the connector stores their blocks, then
    empty the local prefix cache."""
    records = session.run(
        [(k, t, {"load": "none"} if connector else None, 0) for k, t in requests]
    )
    session.reset_prefix_cache()
    return records


def _load(requests, connector: bool, **params):
    """(key, tokens, params, expected cached) rows for requests that hit."""
    return [
        (k, t, {"load": "sync", **params} if connector else None, expected)
        for k, t, expected in requests
    ]


def _stored_prompt_hit(tokens: list[int]) -> int:
    """The hit of a prompt whose every full block is stored: the whole prompt
    but its last token, in tokens."""
    return min(len(tokens) // B * B, len(tokens) - 1)


@scenario
def sync_load(s: Session, c: bool, obs: Observation) -> list[RequestRecord]:
    """A prompt sharing a 256-token prefix with a stored one, and the stored
    prompt itself, loaded synchronously."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    return out + s.run(
        _load([("hit-b", b, PREFIX), ("hit-a", a, _stored_prompt_hit(a))], c),
        observation=obs,
    )


@scenario
def async_load(s: Session, c: bool, obs: Observation) -> list[RequestRecord]:
    """As sync-load, loaded asynchronously (WAITING_FOR_REMOTE_KVS), one of the
    loads completing two steps later."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    rows = _load([("hit-b", b, PREFIX)], c, load="async")
    rows += _load(
        [("hit-a", a, _stored_prompt_hit(a))], c, load="async", load_delay_steps=2
    )
    return out + s.run(rows, observation=obs)


@scenario
def local_then_external(s: Session, c: bool, obs: Observation):
    """A local prefix-cache hit of 128 tokens, then 128 external tokens."""
    a = _prefix() + _p(201, 40)
    half = _prefix()[:128] + _p(203, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    out += s.run([("local-half", half, {"load": "none"} if c else None, 0)])
    return out + s.run(_load([("hit-b", b, PREFIX)], c), observation=obs)


@scenario
def ends_inside_block(s: Session, c: bool, obs: Observation):
    """A synchronous external hit of 200 tokens: it ends inside block 12."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    return out + s.run(
        _load([("hit-b", b, 200)], c, max_hit_tokens=200), observation=obs
    )


@scenario
def ends_inside_block_async(s: Session, c: bool, obs: Observation):
    """An asynchronous external hit of 200 tokens, ending inside block 12."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    rows = _load([("hit-b", b, 200)], c, load="async", max_hit_tokens=200)
    return out + s.run(rows, observation=obs)


@scenario
def whole_prompt(s: Session, c: bool, obs: Observation):
    """P/D-like: every block of a 288-token prompt is stored; it is loaded
    again whole but its last token (287 tokens), which is recomputed."""
    d = _prefix() + _p(204, 32)
    out = _store(s, [("store-d", d)], c)
    return out + s.run(_load([("whole-d", d, len(d) - 1)], c), observation=obs)


@scenario
def whole_prompt_async(s: Session, c: bool, obs: Observation):
    """As whole-prompt, loaded asynchronously."""
    d = _prefix() + _p(204, 32)
    out = _store(s, [("store-d", d)], c)
    rows = _load([("whole-d", d, len(d) - 1)], c, load="async")
    return out + s.run(rows, observation=obs)


@scenario
def batch_shared_prefix(s: Session, c: bool, obs: Observation):
    """Four requests with the stored prefix and different suffixes, together."""
    a = _prefix() + _p(201, 40)
    out = _store(s, [("store-a", a)], c)
    rows = [
        (f"batch-{i}", _prefix() + _p(210 + i, 24 + 8 * i), PREFIX) for i in range(4)
    ]
    return out + s.run(_load(rows, c), observation=obs)


@scenario
def load_failure(s: Session, c: bool, obs: Observation):
    """The first load of block position 6 fails (invalid blocks); the engine
    recomputes (kv_load_failure_policy=recompute). The cached-token count is
    not checked: the engine reports what it scheduled first."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    rows = _load([("fail-b", b, None)], c, fail_positions=[6])
    return out + s.run(rows, observation=obs)


@scenario
def load_failure_async(s: Session, c: bool, obs: Observation):
    """As load-failure, with an asynchronous load."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    rows = _load([("fail-b", b, None)], c, load="async", fail_positions=[6])
    return out + s.run(rows, observation=obs)


@scenario
def load_failure_persistent(s: Session, c: bool, obs: Observation):
    """A connector whose load of block position 6 fails at every attempt
    while its lookup keeps offering the hit (asynchronous load)."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    rows = _load(
        [("fail-b", b, None)], c, load="async", fail_positions=[6], fail_times=10**6
    )
    return out + s.run(rows, observation=obs)


@scenario
def chunked_prefill(s: Session, c: bool, obs: Observation):
    """With a token budget of 32 per step: the stored prompt is computed in
    chunks (saved across steps), the loading one computes its 104 new tokens in
    chunks after a 256-token hit."""
    a = _prefix() + _p(201, 104)
    b = _prefix() + _p(202, 104)
    out = _store(s, [("store-a", a)], c)
    return out + s.run(_load([("hit-b", b, PREFIX)], c), observation=obs)


@scenario
def preemption(s: Session, c: bool, obs: Observation):
    """Four requests, each with its own stored 256-token prefix (no sharing),
    a 256-token external hit and 96 generated tokens, in a pool too small for
    all of them: some are preempted (and load their prefix again on resume)."""
    prompts = [_p(300 + i, PREFIX) + _p(220 + i, 40) for i in range(4)]
    out = _store(s, [(f"store-{i}", t) for i, t in enumerate(prompts)], c)
    rows = [
        (f"pre-{i}", t[:PREFIX] + _p(320 + i, 40), PREFIX)
        for i, t in enumerate(prompts)
    ]
    return out + s.run(_load(rows, c), max_tokens=96, observation=obs)


LONG = 1024


@scenario
def memory_window(s: Session, c: bool, obs: Observation):
    """A 1024-token external hit (64 blocks) then 40 new tokens: the per-group
    block counts the KV cache manager holds are recorded at every step."""
    a = _prefix(LONG) + _p(205, 40)
    b = _prefix(LONG) + _p(206, 40)
    out = _store(s, [("store-long", a)], c)
    return out + s.run(_load([("long-b", b, LONG)], c), observation=obs)


@scenario
def admission(s: Session, c: bool, obs: Observation):
    """Eight requests, each with its own stored 512-token prefix and a
    512-token external hit, in a pool sized for three with HMA off: how many
    run at once is recorded."""
    prompts = [_p(400 + i, 512) + _p(230 + i, 40) for i in range(8)]
    out = _store(s, [(f"store-{i}", t) for i, t in enumerate(prompts)], c)
    rows = [(f"adm-{i}", t[:512] + _p(430 + i, 40), 512) for i, t in enumerate(prompts)]
    return out + s.run(_load(rows, c), max_tokens=4, observation=obs)


@scenario
def stall(s: Session, c: bool, obs: Observation):
    """Two asynchronous loads of 752 tokens (47 blocks) each, with their own
    prefixes, then 128 new tokens each, in a pool of ~100 blocks (HMA off) and
    a budget of 128 tokens per step (the facts file's stall)."""
    prompts = [_p(500 + i, 752) + _p(240 + i, 128) for i in range(2)]
    out = _store(s, [(f"store-{i}", t) for i, t in enumerate(prompts)], c)
    rows = [
        (f"stall-{i}", t[:752] + _p(540 + i, 128), 752) for i, t in enumerate(prompts)
    ]
    return out + s.run(_load(rows, c, load="async"), max_tokens=16, observation=obs)


@scenario
def control_skip_group(s: Session, c: bool, obs: Observation):
    """Negative control: as sync-load, but the connector does not load one KV
    cache group (with HMA off: one layer). Must be caught as not equal."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = _store(s, [("store-a", a)], c)
    return out + s.run(
        _load([("hit-b", b, PREFIX)], c, skip_group=0, skip_layer=0),
        observation=obs,
    )


@scenario
def pd_store(s: Session, c: bool, obs: Observation):
    """P/D, producer process: computes and stores two prompts."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    return s.run(
        [(k, t, {"load": "none"} if c else None, 0) for k, t in (("pd-a", a),)]
    ) + s.run([("pd-b-ref", b, {"load": "none"} if c else None, 0)])


@scenario
def pd_load(s: Session, c: bool, obs: Observation):
    """P/D, consumer process: another engine process loads what the producer
    stored (the block hashes agree only with the same PYTHONHASHSEED)."""
    b = _prefix() + _p(202, 40)
    a = _prefix() + _p(201, 40)
    return s.run(
        _load(
            [("pd-b", b, _stored_prompt_hit(b)), ("pd-a2", a, _stored_prompt_hit(a))], c
        ),
        observation=obs,
    )


@scenario
def lmcache_load(s: Session, c: bool, obs: Observation):
    """LMCache's own path (chunks of 256 tokens, local CPU backend): a prompt
    is stored during its steps; after the local prefix cache is emptied, two
    prompts sharing its first chunk load it (256 tokens each)."""
    a = _prefix() + _p(201, 40)
    b = _prefix() + _p(202, 40)
    out = s.run([("store-a", a, None, 0)])
    s.reset_prefix_cache()
    return out + s.run(
        [
            ("hit-b", b, None, PREFIX if c else None),
            ("hit-a", a, None, PREFIX if c else None),
        ],
        observation=obs,
    )


@scenario
def control_lmcache_skip_layer(s: Session, c: bool, obs: Observation):
    """Negative control: as lmcache-load, but the copy into vLLM's KV cache
    leaves the first layer of every copy call (of every KV cache group)
    unwritten. Must be caught as not equal."""
    if c:
        from hmastack_testkit.e2e import lmcache_cpu

        lmcache_cpu.SKIP_LAYER = 0
    return lmcache_load(s, c, obs)


SERVER_PROMPT = 296


@scenario
def server_smoke(s: Session, c: bool, obs: Observation):
    """The reference of the server smoke test (``server.py``): the same
    prompt twice in-process. With a connector the driver runs ``vllm serve``
    instead of this function."""
    a = _prefix() + _p(201, SERVER_PROMPT - PREFIX)
    return s.run([("first", a, None, None)]) + s.run([("second", a, None, None)])


# --- KV cache events: a router's prediction of every prefix cache hit. A
# stream of requests, one after another, with prefixes of six shared families
# cut at random lengths, in the small pool of the "kv-events" engine (the
# stream evicts); the connector stores some requests and loads others. Before
# each request the subscriber (hmastack_testkit.kv_events) has received every
# event so far and predicts the engine's local prefix cache hit from them; the
# request's expected cached tokens are that prediction plus the external
# tokens the connector then offers, so the host's cached-token check compares
# prediction and report for every request.

KV_EVENTS_REQUESTS = 48


def _external_tokens(req_id: str) -> int:
    """The external tokens the connector offered request ``req_id``."""
    from hmastack_testkit.e2e import connector

    for inst in list(connector.INSTANCES):
        if req_id in inst.stats.hits:
            return inst.stats.hits[req_id]
    return 0


def _drain_events(s: Session) -> None:
    """Receive every event the engine published so far: wait until the
    publisher's queue is empty, then until no batch comes for a while."""
    publisher = s.scheduler.kv_event_publisher
    queue = getattr(publisher, "_event_queue", None)
    deadline = time.monotonic() + 30.0
    while queue is not None and not queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    s.kv_events.drain()


def _kv_events_stream(s: Session, c: bool, obs: Observation, by_group: bool):
    import random

    rng = random.Random(32)
    families = [_p(300 + i, 96 + 16 * i) for i in range(6)]
    sub = s.kv_events if c else None
    if c and sub is None:
        raise RuntimeError("the engine publishes no KV cache events (kv-events)")
    counts = {"requests": 0, "mispredictions": 0, "events": 0}
    # The driver emptied the prefix cache before the scenario; the engine
    # publishes that (AllBlocksCleared) with its next step: one request that
    # shares nothing, not predicted.
    out = s.run([("warm-up", _p(999, 24), {"load": "none"} if c else None, None)])
    if sub is not None:
        _drain_events(s)
        counts["events"] -= sub.indexes[by_group].num_events
        counts["removed"] = -sub.indexes[by_group].num_removed
    for i in range(KV_EVENTS_REQUESTS):
        family = families[rng.randrange(len(families))]
        cut = rng.randrange(1, len(family) + 1)
        tokens = family[:cut] + _p(1000 + i, rng.randrange(1, 40))
        load = rng.choice(["none", "none", "sync"])
        key = f"r{i}"
        predicted = None
        req_id = f"{key}#{s._next_id}"  # the id Session.run gives it
        if sub is not None:
            _drain_events(s)
            predicted = sub.indexes[by_group].predict(tokens)
        (record,) = s.run(
            [(key, tokens, {"load": load} if c else None, None)], max_tokens=2
        )
        if predicted is not None:
            record.expected_cached = predicted + _external_tokens(req_id)
            counts["requests"] += 1
            counts["mispredictions"] += (
                record.expected_cached != record.num_cached_tokens
            )
        out.append(record)
    if sub is not None:
        _drain_events(s)
        counts["events"] += sub.indexes[by_group].num_events
        counts["removed"] += sub.indexes[by_group].num_removed
        counts["batches"] = sub.num_batches
        counts["sequence_gaps"] = sub.gaps
        obs.kv_events = counts
    return out


@scenario
def kv_events_router(s: Session, c: bool, obs: Observation):
    """The subscriber keeps one index per KV cache group from the events."""
    return _kv_events_stream(s, c, obs, by_group=True)


@scenario
def control_kv_events_without_group(s: Session, c: bool, obs: Observation):
    """Negative control: the subscriber ignores which group an event names."""
    return _kv_events_stream(s, c, obs, by_group=False)


# --- KV cache events of every medium: the stream of kv-events-router with
# vLLM's OffloadingConnector (the testkit's CPU spec), whose CPU tier publishes
# the blocks it stores and evicts. Every sixth request the local prefix cache
# is emptied (after the stores finished), so that the CPU tier serves; the
# engine publishes that with its next step, which a request sharing nothing
# takes (not predicted). Before each other request the subscriber predicts
# the cached tokens the engine then reports from the GPU and CPU events alone
# (Index.predict_tier): the local hit, extended by what the CPU tier can load.

KV_EVENTS_OFFLOAD_REQUESTS = 36


def _kv_events_offload_stream(s: Session, c: bool, obs: Observation):
    import random

    from hmastack_testkit.kv_events import MEDIUM_CPU

    rng = random.Random(33)
    families = [_p(330 + i, 96 + 16 * i) for i in range(6)]
    sub = s.kv_events if c else None
    if c and sub is None:
        raise RuntimeError("the engine publishes no KV cache events (kv-events)")
    counts = {"requests": 0, "mispredictions": 0, "tier_hits": 0, "events": 0}
    out = s.run([("warm-up", _p(998, 24), None, None)])
    if sub is not None:
        _settle(s)
        _drain_events(s)
        counts["events"] -= sub.indexes[True].num_events
        counts["removed"] = -sub.indexes[True].num_removed
        counts["cpu_removed"] = -sub.indexes[True].removed_by_medium.get(MEDIUM_CPU, 0)
    for i in range(KV_EVENTS_OFFLOAD_REQUESTS):
        if i % 6 == 5:
            _offload_reset(s)
            out += s.run([(f"reset{i}", _p(2000 + i, 24), None, None)], max_tokens=2)
        family = families[rng.randrange(len(families))]
        cut = rng.randrange(1, len(family) + 1)
        tokens = family[:cut] + _p(1100 + i, rng.randrange(1, 40))
        predicted = local = None
        if sub is not None:
            _settle(s)
            _drain_events(s)
            predicted = sub.indexes[True].predict_tier(tokens)
            local = sub.indexes[True].predict(tokens)
        (record,) = s.run([(f"r{i}", tokens, None, None)], max_tokens=2)
        if predicted is not None:
            record.expected_cached = predicted
            counts["requests"] += 1
            counts["mispredictions"] += predicted != record.num_cached_tokens
            counts["tier_hits"] += record.num_cached_tokens > local
        out.append(record)
    if sub is not None:
        _settle(s)
        _drain_events(s)
        counts["events"] += sub.indexes[True].num_events
        counts["removed"] += sub.indexes[True].num_removed
        counts["cpu_removed"] += sub.indexes[True].removed_by_medium.get(MEDIUM_CPU, 0)
        counts["batches"] = sub.num_batches
        counts["sequence_gaps"] = sub.gaps
        obs.kv_events = counts
    return out


@scenario
def kv_events_offload_router(s: Session, c: bool, obs: Observation):
    """The subscriber keeps the GPU and the CPU tier's blocks per KV cache
    group and predicts every hit, local or loaded from the CPU tier."""
    return _kv_events_offload_stream(s, c, obs)


# --- P/D with vLLM's NixlConnector: two engine processes, NIXL over UCX on
# 127.0.0.1. The producer prefills with max_tokens=1 and hands its
# kv_transfer_params (the blocks to read, its side channel) to the consumer
# through a file in the pair's store folder; the consumer reads the blocks with
# NIXL and decodes; the producer keeps stepping until the consumer is done, so
# that its connector takes the consumer's notification and frees the blocks.

NIXL_PROMPT = 200
NIXL_WAIT_SECONDS = 200.0


def _nixl_prompt() -> list[int]:
    return _prefix(160) + _p(211, NIXL_PROMPT - 160)


def _nixl_folder(s: Session) -> Path:
    assert s.plan.store_dir is not None, "a P/D pair shares a store folder"
    folder = s.plan.store_dir / "nixl"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


HANDOFF = "handoff.json"


def write_handoff(folder: Path, params: list[dict]) -> None:
    """What a P/D producer hands its consumer: ``{"params": [...]}``, the
    kv_transfer_params of each request it prefilled, in order."""
    tmp = folder / (HANDOFF + ".tmp")
    tmp.write_text(json.dumps({"params": params}))
    tmp.rename(folder / HANDOFF)  # the other process never reads half a file


def read_handoff(folder: Path, step=None, seconds: float = NIXL_WAIT_SECONDS) -> list:
    """The producer's kv_transfer_params (:func:`write_handoff`), once it
    wrote them."""
    wait_for(folder / HANDOFF, "kv_transfer_params from the producer", step, seconds)
    return json.loads((folder / HANDOFF).read_text())["params"]


def wait_for(
    path: Path, what: str, step=None, seconds: float = NIXL_WAIT_SECONDS
) -> None:
    """Until the other side of a P/D pair wrote ``path``, calling ``step``
    (e.g. the engine's) meanwhile; a TimeoutError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {seconds:.0f} s ({path})")
        if step is not None:
            step()
        time.sleep(0.05)


@scenario
def nixl_produce(s: Session, c: bool, obs: Observation):
    """P/D with NixlConnector, the producer: prefills the prompt (one token),
    hands its kv_transfer_params to the consumer and keeps stepping until the
    consumer has read the blocks; reports the blocks it still holds then."""
    tokens = _nixl_prompt()
    free_before = s.num_free_blocks()
    out = s.run(
        [("nixl-produce", tokens, {"do_remote_decode": True}, 0)],
        max_tokens=1,
        observation=obs,
    )
    params = out[0].returned_kv_transfer_params
    if not params:
        raise RuntimeError(
            "the producer's NixlConnector returned no kv_transfer_params"
        )
    folder = _nixl_folder(s)
    write_handoff(folder, [params])
    wait_for(folder / "done", "consumer", step=s.llm.llm_engine.step)
    # The consumer's notification reaches the producer's worker at its next
    # step: a bounded number of steps to release the blocks.
    for _ in range(100):
        if s.num_free_blocks() == free_before:
            break
        s.llm.llm_engine.step()
        time.sleep(0.02)
    obs.blocks_held_after_read = free_before - s.num_free_blocks()
    return out


def _nixl_consume(
    s: Session, c: bool, obs: Observation, tamper=None, expected: int | None = None
):
    tokens = _nixl_prompt()
    if not c:
        return s.run([("nixl-a", tokens, None, None)], observation=obs)
    folder = _nixl_folder(s)
    (params,) = read_handoff(folder)
    if tamper is not None:
        params = tamper(params)
    if expected is None:
        # NixlConnector offers every prompt token but the last.
        expected = len(tokens) - 1
    try:
        return s.run([("nixl-a", tokens, params, expected)], observation=obs)
    finally:
        (folder / "done").write_text("done")


@scenario
def nixl_consume(s: Session, c: bool, obs: Observation):
    """P/D with NixlConnector, the consumer: reads the producer's blocks with
    NIXL (the prompt but its last token) and decodes."""
    return _nixl_consume(s, c, obs)


def _rotate_blocks(params: dict) -> dict:
    """The producer's blocks, each read into the slot of the next one."""
    ids = params["remote_block_ids"]
    if ids and isinstance(ids[0], list):  # one list per KV cache group
        rotated = [group[1:] + group[:1] for group in ids]
    else:
        rotated = ids[1:] + ids[:1]
    return {**params, "remote_block_ids": rotated}


@scenario
def control_nixl_rotated_blocks(s: Session, c: bool, obs: Observation):
    """Negative control: the consumer reads the producer's blocks in the wrong
    order (each block's KV lands in the next block's slot)."""
    return _nixl_consume(s, c, obs, tamper=_rotate_blocks)


# NixlConnector's descriptor of block b in region r is r * num_blocks + b: an
# offset past every region's descriptors, which the base's NIXL refuses too
# (an id just past num_blocks lands in another region; from stage 06 the
# consumer refuses it before the read, the base reads the wrong KV).
OUT_OF_RANGE = 10**9


def _blocks_out_of_range(params: dict) -> dict:
    """Block ids past the producer's registered descriptors: NIXL refuses the
    read (NIXL_ERR_INVALID_PARAM)."""
    ids = params["remote_block_ids"]
    if ids and isinstance(ids[0], list):  # one list per KV cache group
        moved = [[b + OUT_OF_RANGE for b in group] for group in ids]
    else:
        moved = [b + OUT_OF_RANGE for b in ids]
    return {**params, "remote_block_ids": moved}


@scenario
def server_pd_nixl(s: Session, c: bool, obs: Observation):
    """The reference of the P/D server pair (``server.run_pd``): the prompt
    in-process. With NixlConnector the driver runs two ``vllm serve`` and a
    proxy instead of this function."""
    return s.run([("pd", _nixl_prompt(), None, None)], observation=obs)


@scenario
def nixl_consume_failed_read(s: Session, c: bool, obs: Observation):
    """P/D with NixlConnector, a read that fails: the consumer's worker reports
    the request's blocks as failed loads and the scheduler recomputes them."""
    return _nixl_consume(s, c, obs, tamper=_blocks_out_of_range)


@scenario
def control_nixl_other_layout(s: Session, c: bool, obs: Observation):
    """Negative control: the consumer runs with HMA off, its producer with HMA
    on (another KV cache group layout): the handshake refuses the producer and
    nothing is read."""
    return _nixl_consume(s, c, obs)


@scenario
def control_nixl_tables_of_another_layout(s: Session, c: bool, obs: Observation):
    """Negative control: the consumer runs with HMA on, its producer with HMA
    off: the producer's one block table does not fit the consumer's groups and
    nothing is read."""
    return _nixl_consume(s, c, obs)


@scenario
def control_nixl_group_not_read(s: Session, c: bool, obs: Observation):
    """Negative control: the consumer's worker leaves the full-attention KV
    cache group out of its read (the other groups are read)."""
    if not c:
        return _nixl_consume(s, c, obs)
    from vllm.distributed.kv_transfer.kv_connector.v1 import nixl_connector

    worker = nixl_connector.NixlConnectorWorker
    read_blocks = worker._read_blocks
    full = s.group_kinds().index("FullAttentionSpec")

    def skip_group(self, *args, **kwargs):
        local = kwargs.get("local_block_ids_per_group")
        remote = kwargs.get("remote_block_ids_per_group")
        if local is not None and remote is not None:
            kwargs["local_block_ids_per_group"] = [
                [] if g == full else blocks for g, blocks in enumerate(local)
            ]
            kwargs["remote_block_ids_per_group"] = [
                [] if g == full else blocks for g, blocks in enumerate(remote)
            ]
        return read_blocks(self, *args, **kwargs)

    worker._read_blocks = skip_group
    try:
        return _nixl_consume(s, c, obs)
    finally:
        worker._read_blocks = read_blocks


# --- vLLM's OffloadingConnector with the CPU test spec
# (hmastack_testkit.offloading): blocks go to the second tier as they fill;
# once the local prefix cache is emptied, a prompt's blocks come back from it
# (asynchronous loads). Stores may read their blocks steps after they started
# (the engine's store_delay_steps); a finished request keeps its blocks until
# its stores finished, so the engine steps until every request is gone before
# the prefix cache can be emptied.

SETTLE_STEPS = 50


def _settle(s: Session) -> None:
    """Step the engine until no finished request holds blocks for a store."""
    for _ in range(SETTLE_STEPS):
        if not s.scheduler.requests:
            return
        s.llm.llm_engine.step()
    raise RuntimeError(
        f"requests {sorted(s.scheduler.requests)} still hold blocks after "
        f"{SETTLE_STEPS} steps"
    )


def _offload_reset(s: Session) -> None:
    _settle(s)
    s.reset_prefix_cache()


OFFLOAD_PROMPT = LONG + 40


@scenario
def offload_reload(s: Session, c: bool, obs: Observation):
    """A 1064-token prompt is served; once its stores finished the local
    prefix cache is emptied and the same prompt is served again: its full
    blocks (1056 tokens) come from the second tier."""
    a = _prefix(LONG) + _p(205, OFFLOAD_PROMPT - LONG)
    out = s.run([("store", a, None, 0)])
    _offload_reset(s)
    out += s.run(
        [("reload", a, None, _stored_prompt_hit(a) if c else None)], observation=obs
    )
    _settle(s)
    return out


def _store_race(s: Session, c: bool, obs: Observation, seed: int):
    """The stored prompt A (1064 tokens) and B (296 tokens, another prefix)
    arrive together; B fits only once A's sliding windows freed their blocks.
    Then, from the second tier: C, A's first 256 tokens and a suffix (its
    sliding-window groups read blocks 14 and 15, which A's windows freed while
    the store read them), and A itself. ``seed``: prompts of their own (the
    second tier keeps what earlier scenarios of the process stored)."""
    a = _p(seed, LONG) + _p(seed + 1, OFFLOAD_PROMPT - LONG)
    b = _p(seed + 2, PREFIX) + _p(seed + 3, 40)
    c_prompt = a[:PREFIX] + _p(seed + 4, 40)
    out = s.run([("store-a", a, None, 0), ("other-b", b, None, 0)], observation=obs)
    _offload_reset(s)
    out += s.run(
        [
            ("prefix-c", c_prompt, None, PREFIX if c else None),
            ("whole-a", a, None, _stored_prompt_hit(a) if c else None),
        ],
        observation=obs,
    )
    _settle(s)
    return out


@scenario
def offload_store_race(s: Session, c: bool, obs: Observation):
    """Stores read their blocks two steps late; the hold keeps the blocks the
    sliding windows free until the stores finished."""
    return _store_race(s, c, obs, seed=700)


@scenario
def control_offload_no_hold(s: Session, c: bool, obs: Observation):
    """Negative control: OffloadingConnector holds no block for its stores
    (request_blocks_freed returns none): another request reuses blocks the
    stores still read."""
    if not c:
        return _store_race(s, c, obs, seed=750)
    from hmastack_testkit.e2e import offload_observe

    restore = offload_observe.disable_hold()
    try:
        return _store_race(s, c, obs, seed=750)
    finally:
        restore()


# --- a Mamba hybrid (models: bamba-like). A Mamba layer reads only its state
# after the last computed token; a Mamba block (64 tokens, the attention
# block size vLLM sets for the model) holds the state after its last token.
# External tokens end on the last block boundary before the prompt's last
# token, which is computed from the state before it: 192 of 200 tokens.

MAMBA_BLOCK = 64


def _mamba_hit(tokens: list[int]) -> int:
    return (len(tokens) - 1) // MAMBA_BLOCK * MAMBA_BLOCK


def _mamba_groups(s: Session) -> list[int]:
    """The Mamba KV cache groups (bamba-like: one per Mamba layer, as its one
    attention layer is a group of its own)."""
    return [g for g, kind in enumerate(s.group_kinds()) if kind == "MambaSpec"]


@scenario
def mamba_nixl_consume(s: Session, c: bool, obs: Observation):
    """P/D with NixlConnector on the Mamba hybrid, the consumer: reads the
    producer's attention blocks and its Mamba state block up to the last
    boundary before the prompt's last token (192 of 200 tokens), computes the
    rest and decodes."""
    return _nixl_consume(s, c, obs, expected=_mamba_hit(_nixl_prompt()))


@scenario
def control_mamba_nixl_other_layers_state(s: Session, c: bool, obs: Observation):
    """Negative control: the consumer reads, into each Mamba group's state
    block, the producer's state block of the next Mamba group (another
    layer's state after the same token), with the right attention blocks."""

    def other_layers_state(params: dict) -> dict:
        ids = [list(group) for group in params["remote_block_ids"]]
        mamba = _mamba_groups(s)
        rotated = mamba[1:] + mamba[:1]
        for g, other in zip(mamba, rotated, strict=True):
            ids[g] = list(params["remote_block_ids"][other])
        return {**params, "remote_block_ids": ids}

    if not c:
        return _nixl_consume(s, c, obs)
    return _nixl_consume(
        s, c, obs, tamper=other_layers_state, expected=_mamba_hit(_nixl_prompt())
    )


def _mamba_offload(s: Session, c: bool, obs: Observation, seed: int, tamper=None):
    """A 200-token prompt is served; once its stores finished the local prefix
    cache is emptied and the same prompt is served again: 192 tokens come
    back from the second tier (the attention blocks and the Mamba state block
    after token 191). ``tamper(s)`` runs before the second request."""
    a = _p(seed, 200)
    out = s.run([("store", a, None, 0)])
    _offload_reset(s)
    if tamper is not None and c:
        tamper(s)
    out += s.run([("reload", a, None, _mamba_hit(a) if c else None)], observation=obs)
    _settle(s)
    return out


@scenario
def mamba_offload_reload(s: Session, c: bool, obs: Observation):
    """OffloadingConnector on the Mamba hybrid: stored, emptied, reloaded."""
    return _mamba_offload(s, c, obs, seed=900)


def _zero_offloaded_mamba_states(s: Session) -> None:
    """Zero the second tier's copy of every Mamba state block."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
    from vllm.v1.core.kv_cache_utils import get_group_id

    mamba = _mamba_groups(s)
    manager = s.scheduler.connector.connector_scheduler.manager
    slots = [
        status.block_id
        for key, status in manager.blocks.items()
        if get_group_id(key) in mamba
    ]
    if not slots:
        raise RuntimeError("no offloaded Mamba state block to corrupt")
    store, _ = get_kv_transfer_group().connector_worker.spec._torch_handlers
    for layer in store.layers:
        layer.cpu[slots] = 0


@scenario
def control_mamba_offload_zero_state(s: Session, c: bool, obs: Observation):
    """Negative control: the second tier's Mamba state blocks are zeroed
    before the reload (the attention blocks are intact)."""
    return _mamba_offload(s, c, obs, seed=950, tamper=_zero_offloaded_mamba_states)
