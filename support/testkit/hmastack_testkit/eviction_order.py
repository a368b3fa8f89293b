"""EvictionOrder: blocks a KV connector held (`request_blocks_freed`) go to
the free block queue in the order an immediate free would have put them
there, checked on a real `Scheduler`'s free block queue.

vLLM frees a request's blocks tail first: `KVCacheCoordinator.free` and
`remove_skipped_blocks` take the KV cache groups in order, each from its last
block to its first, and append the blocks whose reference count drops to 0
to the free block queue, whose head the next allocation evicts. Number every
block that leaves a block table in that order, over all the frees of the
scheduler (its *place*; a block that leaves tables several times, e.g. after
a prefix cache hit put it back in one, or that several requests share, has
the place of the last time a table dropped it: where an immediate free puts
it in the queue). The property, checked on the queue after each
`update_from_output` (the only call that releases held blocks, when the
connector reports requests in `finished_sending`):

  The held blocks that enter the free queue in the call (they were held
  for some request and in no block table before it, and are free after
  it) enter it in increasing place, one after the other: no other block
  enters the queue between them.

A released block that a block table or another hold still references
stays out of the queue (its reference count is not 0); it enters the queue
with the free that drops its last reference, and is not one of the blocks
this property orders.

`EvictionOrder(scheduler)` observes the scheduler: it wraps the KV cache
coordinator's `free` and `remove_skipped_blocks` (to number the blocks
leaving the tables, from the tables themselves, whatever order the
scheduler asks its connector in) and the scheduler's `update_from_output`
(to compare the queue before and after). `check()` raises an AssertionError
naming the first violation.
"""

from __future__ import annotations

from typing import Any


def _tables(coordinator, request_id: str) -> list[list[Any]]:
    return [
        list(manager.req_to_blocks.get(request_id) or ())
        for manager in coordinator.single_type_managers
    ]


class EvictionOrder:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        manager = scheduler.kv_cache_manager
        self.manager = manager
        self.queue = manager.block_pool.free_block_queue
        coordinator = manager.coordinator
        self.coordinator = coordinator
        # block_id -> its place: the last time a block table dropped it.
        self.places: dict[int, int] = {}
        self.num_left = 0
        self.violations: list[str] = []
        # What the last update_from_output released, for coverage notes.
        self.last_released: list[int] = []

        free = coordinator.free
        remove_skipped_blocks = coordinator.remove_skipped_blocks

        def observed_free(request_id: str, *args, **kwargs):
            self._left([list(reversed(t)) for t in _tables(coordinator, request_id)])
            return free(request_id, *args, **kwargs)

        def observed_remove_skipped_blocks(request_id: str, *args, **kwargs):
            before = _tables(coordinator, request_id)
            result = remove_skipped_blocks(request_id, *args, **kwargs)
            after = _tables(coordinator, request_id)
            self._left(
                [
                    [
                        b
                        for i, b in reversed(list(enumerate(old)))
                        if not b.is_null and i < len(new) and new[i].is_null
                    ]
                    for old, new in zip(before, after, strict=True)
                ]
            )
            return result

        coordinator.free = observed_free
        coordinator.remove_skipped_blocks = observed_remove_skipped_blocks

        update_from_output = scheduler.update_from_output

        def observed_update_from_output(*args, **kwargs):
            queue_before = self._queue()
            held_before = {
                b.block_id for blocks in manager.held_blocks.values() for b in blocks
            }
            in_tables_before = {
                b.block_id
                for m in coordinator.single_type_managers
                for table in m.req_to_blocks.values()
                for b in table
            }
            result = update_from_output(*args, **kwargs)
            self._check_released(queue_before, held_before, in_tables_before)
            return result

        scheduler.update_from_output = observed_update_from_output

    def _queue(self) -> list[int]:
        return [b.block_id for b in self.queue.get_all_free_blocks()]

    def _left(self, groups: list[list[Any]]) -> None:
        """Blocks leave the tables in this order: groups in order, each
        already from its last block to its first."""
        for blocks in groups:
            for block in blocks:
                if block.is_null:
                    continue
                self.places[block.block_id] = self.num_left
                self.num_left += 1

    def _check_released(
        self, queue_before: list[int], held_before: set[int], in_tables: set[int]
    ) -> None:
        before = set(queue_before)
        entered = [b for b in self._queue() if b not in before]
        released = [b for b in entered if b in held_before and b not in in_tables]
        self.last_released = released
        if not released:
            return
        unplaced = [b for b in released if b not in self.places]
        if unplaced:
            self.violations.append(
                f"held blocks {unplaced} entered the free queue, but never left "
                "a block table"
            )
            return
        places = [self.places[b] for b in released]
        if places != sorted(places):
            self.violations.append(
                f"held blocks {released} entered the free queue at places "
                f"{places}, not in the order in which they left the block tables"
            )
            return
        first = entered.index(released[0])
        if entered[first : first + len(released)] != released:
            self.violations.append(
                f"other blocks entered the free queue between the released held "
                f"blocks {released}: {entered}"
            )

    def check(self) -> None:
        if self.violations:
            raise AssertionError(self.violations[0])
