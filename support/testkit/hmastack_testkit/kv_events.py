"""A reference subscriber of vLLM's KV cache events, as a KV-aware router keeps
them: a ZMQ SUB socket on 127.0.0.1, the publisher's msgpack batches decoded
with msgspec into structs of its own (not vLLM's classes), and an index from
which it predicts an engine's prefix cache hit for a prompt.

The wire format is vLLM's ``ZmqEventPublisher``'s: multipart messages
``(topic, sequence number as 8 bytes big-endian, payload)``, the payload a
``KVEventBatch`` (array-like, events tagged by their class name). An endpoint of
the form ``tcp://HOST:PORT`` makes the publisher connect, so the subscriber binds
it (:attr:`Subscriber.endpoint`).

The index knows blocks by hash. Each ``BlockStored`` of the engine (medium
``GPU``) says a block's parent and tokens, so the index maps (parent hash,
tokens) to the block's hash and finds a prompt's block hashes without the
engine's hash function. Per KV cache group and per medium (the engine's
``GPU``, OffloadingConnector's second tier ``CPU``) it keeps the hashes stored
and not removed; ``AllBlocksCleared`` (the engine's prefix cache reset) empties
the ``GPU`` medium. A group is the event's ``group_idx`` with its
``kv_cache_spec_*`` fields and ``use_eagle``; an event without them (an engine
without those fields, or with the hybrid KV cache manager off) is one full
attention group.

The router rule (``patches/*-kv-events-hma/README.md``), as code a check can
call:

- :func:`needed_blocks`: the blocks a prefix cache hit of L tokens needs in one
  group (full attention: every block before L; sliding window W: the
  cdiv(W - 1, B) blocks before L; chunked local attention C: the blocks of
  [L // C * C, L); Mamba: the block of token L - 1, the state after it; with
  eagle also block L / B, the block after the hit, in every group but a Mamba
  group);
- :func:`longest_hit`: the engine's prefix cache hit of a prompt, the longest L
  every group serves, below its last token (with eagle, the block after the hit
  ends at or before it), a multiple of every group's block size;
- :meth:`Index.predict`: that rule over the blocks the ``GPU`` events hold;
- :meth:`Index.predict_tier`: the hit of a request that a KV connector's tier
  (``CPU``) extends beyond the local hit, as the scheduler reports it.

Both take the prompt's tokens, and optionally its block hashes per block size
in the events' format (vLLM's ``maybe_convert_block_hash`` of
``Request.block_hashes``); :func:`decode_batch` turns a batch the scheduler
publishes into the events an :class:`Index` applies.

``by_group=False`` and ``eagle_aware=False`` are the negative controls: a
subscriber that ignores the group, or ``use_eagle``.

Importable without vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

ExternalBlockHash = bytes | int

# The media of the events: the engine's KV cache (vLLM's MEDIUM_GPU, whatever
# the device) and OffloadingConnector's CPU tier (CPULoadStoreSpec.medium()).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    kv_cache_spec_attention_chunk_size: int | None = None
    use_eagle: bool = False


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    kv_cache_spec_attention_chunk_size: int | None = None
    use_eagle: bool = False


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(batch) -> KVEventBatch:
    """A batch as a subscriber receives it: ``batch`` (vLLM's ``KVEventBatch``,
    as a scheduler hands it to its publisher, or its msgpack bytes) encoded as
    the publisher encodes it and decoded into this module's structs. A check
    that collects the scheduler's batches in-process feeds an :class:`Index`
    with ``decode_batch(batch).events``."""
    payload = batch if isinstance(batch, bytes) else msgspec.msgpack.encode(batch)
    return DECODER.decode(payload)


def needed_blocks(
    kind: str,
    block_size: int,
    num_tokens: int,
    window: int | None = None,
    chunk: int | None = None,
    use_eagle: bool = False,
) -> range:
    """The blocks (indices in blocks of ``block_size``) that a prefix cache hit
    of ``num_tokens`` tokens needs in a KV cache group of ``kind``
    (``full_attention``, ``sliding_window`` with ``window``,
    ``chunked_local_attention`` with ``chunk``, ``mamba``): the blocks before
    it that the next token reads (sliding window: tokens from
    ``num_tokens - window + 1`` on, the cdiv(W - 1, B) blocks before a
    block-aligned hit; chunked local attention: from
    ``num_tokens // chunk * chunk`` on; Mamba: the block of token
    ``num_tokens - 1``, which holds the state after it) and, with eagle, block
    ``num_tokens // block_size``, which eagle computes again (not in a Mamba
    group, which reads only the state)."""
    num_blocks = num_tokens // block_size
    if kind == "mamba":
        return range(max(0, num_blocks - 1), num_blocks)
    first = 0
    if kind == "sliding_window":
        first = max(0, num_tokens - window + 1) // block_size
    elif kind == "chunked_local_attention":
        first = num_tokens // chunk * chunk // block_size
    return range(first, num_blocks + 1 if use_eagle else num_blocks)


@dataclass
class Group:
    """One KV cache group as its events describe it, and the blocks each
    medium holds of it."""

    kind: str
    block_size: int
    window: int | None = None  # sliding window, in tokens
    chunk: int | None = None  # chunked local attention, in tokens
    # the engine runs eagle: its own hit needs the block after it (the hit
    # of a KV connector's tier does not: Index.predict_tier)
    use_eagle: bool = False
    # medium -> hashes stored and not removed
    resident: dict[str, set] = field(default_factory=dict)

    def needed_blocks(self, num_tokens: int, use_eagle: bool | None = None) -> range:
        """:func:`needed_blocks` of this group (``use_eagle`` None: the
        group's)."""
        return needed_blocks(
            self.kind,
            self.block_size,
            num_tokens,
            self.window,
            self.chunk,
            self.use_eagle if use_eagle is None else use_eagle,
        )

    def holds(self, medium: str = MEDIUM_GPU) -> set:
        return self.resident.setdefault(medium, set())

    def serves(
        self, hashes: list, num_tokens: int, medium: str = MEDIUM_GPU, **kw
    ) -> bool:
        """Whether ``medium`` holds every block a hit of ``num_tokens`` needs
        (``hashes``: the prompt's block hashes at this group's block size)."""
        needed = self.needed_blocks(num_tokens, **kw)
        if needed.stop > len(hashes):
            return False
        held = self.holds(medium)
        return all(hashes[i] in held for i in needed)


def longest_hit(
    groups: Sequence[Group],
    num_prompt_tokens: int,
    serves: Callable[[Group, int], bool],
    use_eagle: bool | None = None,
) -> int:
    """The engine's prefix cache hit of a prompt of ``num_prompt_tokens``
    tokens: the longest L, a multiple of every group's block size, below its
    last token (L <= num_prompt_tokens - 1), that every group serves
    (``serves(group, L)``); with eagle (``use_eagle`` None: any group's
    ``use_eagle``) the block after the hit must end at or before the last
    token too. 0 when no L is served (or there is no group)."""
    if not groups:
        return 0
    step = math.lcm(*(g.block_size for g in groups))
    eagle = any(g.use_eagle for g in groups) if use_eagle is None else use_eagle
    max_hit = num_prompt_tokens - 1
    for num_tokens in range(max_hit // step * step, 0, -step):
        if eagle and any(
            num_tokens + g.block_size > max_hit // g.block_size * g.block_size
            for g in groups
        ):
            continue
        if all(serves(g, num_tokens) for g in groups):
            return num_tokens
    return 0


class Index:
    """The index a subscriber keeps from one engine's events."""

    def __init__(self, by_group: bool = True, eagle_aware: bool = True):
        self.by_group = by_group
        self.eagle_aware = eagle_aware
        self.groups: dict[int, Group] = {}
        # per block size: (parent hash, tokens) -> hash, of every block seen
        self.children: dict[int, dict[tuple, ExternalBlockHash]] = {}
        self.num_events = 0
        self.num_removed = 0  # blocks removed (evicted), every medium
        self.removed_by_medium: dict[str, int] = {}

    def _group(self, event: BlockStored | BlockRemoved, block_size: int | None):
        key = event.group_idx if self.by_group and event.group_idx is not None else 0
        group = self.groups.get(key)
        if group is None:
            kind = (event.kv_cache_spec_kind if self.by_group else None) or (
                "full_attention"
            )
            group = Group(
                kind,
                block_size or 0,
                event.kv_cache_spec_sliding_window,
                event.kv_cache_spec_attention_chunk_size,
                use_eagle=self.eagle_aware and event.use_eagle,
            )
            self.groups[key] = group
        elif block_size and not group.block_size:
            group.block_size = block_size
        if self.eagle_aware and event.use_eagle:
            # A group known before its first event (from the engine's KV
            # cache configuration) learns eagle from the events.
            group.use_eagle = True
        return group

    def apply(self, event) -> None:
        self.num_events += 1
        if isinstance(event, AllBlocksCleared):
            for group in self.groups.values():
                group.holds(MEDIUM_GPU).clear()
            return
        medium = event.medium or MEDIUM_GPU
        if isinstance(event, BlockStored):
            group = self._group(event, event.block_size)
            bs = event.block_size
            if event.token_ids:
                children = self.children.setdefault(bs, {})
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
                    children[(parent, tokens)] = block_hash
                    parent = block_hash
            group.holds(medium).update(event.block_hashes)
        else:
            group = self._group(event, None)
            group.holds(medium).difference_update(event.block_hashes)
            self.num_removed += len(event.block_hashes)
            self.removed_by_medium[medium] = self.removed_by_medium.get(
                medium, 0
            ) + len(event.block_hashes)

    def block_hashes(self, tokens: list[int], block_size: int) -> list:
        """The hashes of the prompt's full blocks the index has seen, from the
        first on (up to the first block never seen)."""
        children = self.children.get(block_size, {})
        hashes: list = []
        parent = None
        for i in range(len(tokens) // block_size):
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            block_hash = children.get((parent, block))
            if block_hash is None:
                break
            hashes.append(block_hash)
            parent = block_hash
        return hashes

    def _hashes(self, tokens: list[int], hashes: dict[int, list] | None):
        groups = [g for g in self.groups.values() if g.block_size]
        if hashes is None:
            hashes = {
                g.block_size: self.block_hashes(tokens, g.block_size) for g in groups
            }
        return groups, hashes

    def predict(
        self,
        tokens: list[int],
        medium: str = MEDIUM_GPU,
        hashes: dict[int, list] | None = None,
    ) -> int:
        """The prefix cache hit (tokens) of a prompt: :func:`longest_hit` over
        the blocks ``medium`` holds. ``hashes``: the prompt's block hashes per
        block size, in the events' format (None: found from the ``GPU``
        events' tokens)."""
        groups, hashes = self._hashes(tokens, hashes)
        return longest_hit(
            groups,
            len(tokens),
            lambda g, n: g.serves(hashes[g.block_size], n, medium),
        )

    def predict_tier(
        self,
        tokens: list[int],
        tier: str = MEDIUM_CPU,
        hashes: dict[int, list] | None = None,
        engine_rule: bool = False,
    ) -> int:
        """The computed tokens the scheduler reports for a prompt when a KV
        connector loads from ``tier`` what it holds after the local prefix
        cache hit (OffloadingConnector: its CPU tier; its blocks are the
        engine's block size).

        The local hit L0 is :meth:`predict`. The connector extends it to the
        longest L, a multiple of the block size, L0 < L <= the prompt's full
        blocks, for which ``tier`` holds every block from L0 on that each
        group's block table gets for a request of L computed tokens (the
        blocks the scheduler allocates for external tokens: those its layers
        read before L, from the window of the tokens it computes next,
        ``min(L, len - 1)``; with eagle, of the last block boundary before
        them), and offers at least one block. The scheduler computes the
        last token again when L is the whole prompt: it reports
        ``min(L, len - 1)``, or L0 with no tier hit. With a Mamba group, L
        ends before the last token (the scheduler loads the state after
        token L - 1 and computes the last token from the state before it):
        a prompt of whole blocks gets one block less.

        ``engine_rule=True`` is the negative control with eagle: the rule of
        the engine's own hit (:func:`needed_blocks` with the block after the
        hit, below the last token) applied to the tier, which claims a block
        less than the connector loads."""
        groups, hashes = self._hashes(tokens, hashes)
        local = longest_hit(
            groups,
            len(tokens),
            lambda g, n: g.serves(hashes[g.block_size], n, MEDIUM_GPU),
        )
        if not groups:
            return local
        step = math.lcm(*(g.block_size for g in groups))
        eagle = any(g.use_eagle for g in groups)
        control = engine_rule and eagle

        def loadable(num_tokens: int) -> bool:
            table_start = min(num_tokens, len(tokens) - 1)
            if eagle and not control:
                table_start = (table_start - 1) // step * step
            for g in groups:
                needed = g.needed_blocks(table_start, use_eagle=control)
                stop = needed.stop if control else num_tokens // g.block_size
                blocks = range(max(local // g.block_size, needed.start), stop)
                group_hashes = hashes[g.block_size]
                if blocks.stop > len(group_hashes):
                    return False
                held = g.holds(tier)
                if not all(group_hashes[i] in held for i in blocks):
                    return False
            return True

        # With a Mamba group the loaded tokens end before the last token.
        mamba = any(g.kind == "mamba" for g in groups)
        last = (len(tokens) - mamba) // step * step
        if control:
            # the block after the hit ends at or before the last token
            last = (len(tokens) - 1) // step * step - step
        for num_tokens in range(last, local, -step):
            if num_tokens - local >= step and loadable(num_tokens):
                return min(num_tokens, len(tokens) - 1)
        return local


class Subscriber:
    """A ZMQ SUB socket bound on 127.0.0.1 (a free port) and the indexes it
    feeds: ``indexes[True]`` by group, ``indexes[False]`` ignoring the group."""

    def __init__(self, topic: str = "") -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.indexes = {True: Index(by_group=True), False: Index(by_group=False)}
        self.next_seq: int | None = None
        self.gaps = 0  # sequence numbers missed
        self.num_batches = 0

    def drain(self, quiet_ms: int = 300) -> int:
        """Receive and apply every batch until none comes for ``quiet_ms``;
        returns the number of events received."""
        received = 0
        while self.socket.poll(quiet_ms, self._zmq.POLLIN):
            _topic, seq_bytes, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.next_seq is not None and seq != self.next_seq:
                self.gaps += abs(seq - self.next_seq)
            self.next_seq = seq + 1
            batch = DECODER.decode(payload)
            self.num_batches += 1
            for event in batch.events:
                for index in self.indexes.values():
                    index.apply(event)
            received += len(batch.events)
        return received

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
