"""A reference subscriber of vLLM's KV cache events, as a KV-aware router keeps
them: a ZMQ SUB socket on 127.0.0.1, the publisher's msgpack batches decoded
with msgspec into structs of its own (not vLLM's classes), and an index from
which it predicts an engine's prefix cache hit for a prompt.

The wire format is vLLM's ``ZmqEventPublisher``'s: multipart messages
``(topic, sequence number as 8 bytes big-endian, payload)``, the payload a
``KVEventBatch`` (array-like, events tagged by their class name). An endpoint of
the form ``tcp://HOST:PORT`` makes the publisher connect, so the subscriber binds
it (:attr:`Subscriber.endpoint`).

The index knows blocks by hash. Each ``BlockStored`` says a block's parent and
tokens, so the index maps (parent hash, tokens) to the block's hash and finds a
prompt's block hashes without the engine's hash function. Per KV cache group it
keeps the hashes stored and not removed; the rule of :meth:`Index.predict`
(``patches/*-kv-events-hma/README.md``) gives the longest prefix every group
serves. A group is the event's ``group_idx`` with its ``kv_cache_spec_*`` fields;
an event without them (an engine without those fields, or with the hybrid KV
cache manager off) is one full attention group. ``by_group=False`` is the
negative control: a subscriber that ignores the group.

Importable without vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

ExternalBlockHash = bytes | int


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


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    kv_cache_spec_attention_chunk_size: int | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class Group:
    """What a hit needs of one KV cache group."""

    kind: str
    block_size: int
    window: int | None = None  # sliding window, in tokens
    chunk: int | None = None  # chunked local attention, in tokens
    resident: set = field(default_factory=set)

    def first_needed_block(self, num_blocks: int) -> int:
        """The first block a hit of ``num_blocks`` blocks needs in this group."""
        if self.kind == "sliding_window":
            return max(0, num_blocks - math.ceil((self.window - 1) / self.block_size))
        if self.kind == "chunked_local_attention":
            tokens = num_blocks * self.block_size
            return tokens // self.chunk * self.chunk // self.block_size
        return 0

    def serves(self, hashes: list, num_tokens: int) -> bool:
        num_blocks = num_tokens // self.block_size
        if num_blocks > len(hashes):
            return False
        needed = hashes[self.first_needed_block(num_blocks) : num_blocks]
        return all(h in self.resident for h in needed)


class Index:
    """The index a subscriber keeps from one engine's events."""

    def __init__(self, by_group: bool = True):
        self.by_group = by_group
        self.groups: dict[int, Group] = {}
        # per block size: (parent hash, tokens) -> hash, of every block seen
        self.children: dict[int, dict[tuple, ExternalBlockHash]] = {}
        self.num_events = 0
        self.num_removed = 0  # blocks removed (evicted)

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
            )
            self.groups[key] = group
        elif block_size and not group.block_size:
            group.block_size = block_size
        return group

    def apply(self, event) -> None:
        self.num_events += 1
        if isinstance(event, AllBlocksCleared):
            for group in self.groups.values():
                group.resident.clear()
            return
        if isinstance(event, BlockStored):
            group = self._group(event, event.block_size)
            children = self.children.setdefault(event.block_size, {})
            parent = event.parent_block_hash
            bs = event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
                children[(parent, tokens)] = block_hash
                parent = block_hash
            group.resident.update(event.block_hashes)
        else:
            group = self._group(event, None)
            group.resident.difference_update(event.block_hashes)
            self.num_removed += len(event.block_hashes)

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

    def predict(self, tokens: list[int]) -> int:
        """The prefix cache hit (tokens) of a prompt: the longest prefix below
        its last token that every group serves, a multiple of every group's
        block size."""
        groups = [g for g in self.groups.values() if g.block_size]
        if not groups:
            return 0
        step = math.lcm(*(g.block_size for g in groups))
        hashes = {g.block_size: self.block_hashes(tokens, g.block_size) for g in groups}
        for num_tokens in range((len(tokens) - 1) // step * step, 0, -step):
            if all(g.serves(hashes[g.block_size], num_tokens) for g in groups):
                return num_tokens
        return 0


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
