"""Stage 04: LMCache's vLLM v1 adapter inside vLLM's scheduler loop, on CPU.

Real: vLLM's Scheduler and KV cache manager (stages 01-03), its grouping of
model-like layouts into KV cache groups, ``LMCacheConnectorV1`` in both roles,
LMCache's adapter, ``LMCacheEngine`` with the local CPU backend, its lookup
client and server, and ``VLLMPagedMemGPUConnectorV2``. Faked, because it needs
CUDA, and nothing else: ``hmastack_testkit.lmcache_cuda_boundary``. The model
itself is not run: the harness writes, for each computed token, a K and V that
depend on the layer and the token's prefix only, and checks what each step's
attention reads.
"""

from __future__ import annotations

import os

import pytest
from hmastack_testkit.kvtest import init_one_process_world
from layouts import CHUNK

# LMCache reads its configuration from the environment once per process.
os.environ.setdefault("LMCACHE_CHUNK_SIZE", str(CHUNK))
os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
os.environ.setdefault("LMCACHE_SAVE_DECODE_CACHE", "True")
os.environ.setdefault("LMCACHE_SAVE_UNFULL_CHUNK", "False")


@pytest.fixture(scope="session")
def distributed():
    """A one-process vLLM world (gloo): the adapter asks for its TP rank."""
    init_one_process_world()
    yield


@pytest.fixture
def kernel(monkeypatch):
    from hmastack_testkit import lmcache_cuda_boundary as cuda_boundary

    return cuda_boundary.install(monkeypatch)


@pytest.fixture
def make_engine(kernel, distributed):
    """``make_engine(layout, hma, use_eagle)``: an :class:`~harness.Engine`,
    shut down after the test."""
    from harness import Engine

    engines = []

    def make(layout, hma: bool = True, use_eagle: bool = False):
        engine = Engine(layout, hma, kernel, use_eagle)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
