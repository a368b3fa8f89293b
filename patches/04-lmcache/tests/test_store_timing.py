"""LMCache's stores read vLLM's blocks only inside ``wait_for_save``.

That is the invariant that lets the adapter hold no block: it does not
override ``request_blocks_freed`` (vLLM's hold for stores in flight, stage 03)
and ``request_finished_all_groups`` returns False. Right after each step's
``wait_for_save`` the test overwrites every real block (as vLLM may once it
has the step's output: free the blocks of a finished request or of a window
that slid, and give them to another request), lets anything the step left
running finish, and restores the blocks. LMCache's chunks must still hold the
request's KV.

Negative control (``defer_store``): a store whose copy out of vLLM's blocks
outlives its step (the GPU connector's copies deferred past
``wait_for_save``) reads the overwritten blocks, and the check fails.
"""

from __future__ import annotations

import layouts
import pytest
from harness import Engine

PROMPT = list(range(1000, 2100))  # 1100 tokens; LMCache stores [0, 1024)


def run_with_blocks_overwritten_after_save(engine: Engine, deferred: list) -> None:
    def after_save(_so) -> None:
        saved = {name: buf[:, 1:].clone() for name, buf in engine.buffers.items()}
        for buf in engine.buffers.values():
            buf[:, 1:] = 4242.0  # block 0, the null block, keeps its sentinel
        while deferred:  # what the step left running
            deferred.pop(0)()
        for name, buf in engine.buffers.items():
            buf[:, 1:] = saved[name]

    engine.after_save = after_save
    engine.add(PROMPT)
    engine.run()


@pytest.mark.parametrize("defer_store", [False, True])
@pytest.mark.parametrize(
    "layout", [layouts.gpt_oss_like(), layouts.gemma3_like()], ids=lambda x: x.name
)
def test_stores_read_blocks_only_inside_wait_for_save(
    make_engine, monkeypatch, layout, defer_store
):
    from lmcache.v1.gpu_connector import VLLMPagedMemGPUConnectorV2

    engine = make_engine(layout, hma=True)
    deferred: list = []
    if defer_store:
        from_gpu = VLLMPagedMemGPUConnectorV2.batched_from_gpu

        def deferred_from_gpu(self, *args, **kwargs):
            deferred.append(lambda: from_gpu(self, *args, **kwargs))

        monkeypatch.setattr(
            VLLMPagedMemGPUConnectorV2, "batched_from_gpu", deferred_from_gpu
        )
    run_with_blocks_overwritten_after_save(engine, deferred)
    assert not deferred
    if defer_store:
        with pytest.raises(AssertionError):
            engine.check_stored_prefix(PROMPT[:1024])
    else:
        engine.check_stored_prefix(PROMPT[:1024])
    (finished,) = engine.finished
    assert finished.result == (False, None)
