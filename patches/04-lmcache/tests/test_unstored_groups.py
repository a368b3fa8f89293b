"""Kind 4: KV cache groups LMCache cannot store.

LMCache stores attention KV caches as chunks of ``[2, num_layers, num_tokens,
hidden]``. A model with a Mamba group (whose state LMCache does not store),
or whose layers hold different numbers of values per token, must never get
an LMCache hit that leaves a state unrestored: vLLM must refuse to start,
with an error that names the group or layers and says what to do.
"""

from __future__ import annotations

import layouts
import pytest
from hmastack_testkit import lmcache_cuda_boundary as cuda_boundary
from hmastack_testkit.kvtest import make_scheduler
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole


def start(layout, hma: bool, role: KVConnectorRole):
    """What vLLM's engine start-up does for one role: the KV cache configs of
    the layout, then the connector of the worker, or the scheduler (which
    creates its connector)."""
    vllm_config = layouts.layout_vllm_config(layout, hma)
    worker_config, scheduler_config = layouts.kv_cache_configs(layout, vllm_config)
    if role == KVConnectorRole.WORKER:
        cuda_boundary.build_cpu_engine(vllm_config)
        try:
            return KVConnectorFactory.create_connector(vllm_config, role, worker_config)
        finally:
            cuda_boundary.destroy_engine()
    return make_scheduler(vllm_config, scheduler_config)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_mamba_hybrid_is_refused_at_start_up(kernel, distributed, role):
    """Stage 03's connector factory refuses a Mamba model for every KV
    connector, before LMCache's adapter sees the configuration (the adapter's
    own refusal, naming the group and its layers, is tested in LMCache's
    tests/v1/test_vllm_kv_cache_groups.py)."""
    with pytest.raises(ValueError) as exc_info:
        start(layouts.mamba_hybrid(), True, role)
    message = str(exc_info.value)
    assert "LMCacheConnectorV1" in message and "Mamba" in message
    assert "without --kv-transfer-config" in message
    # Turning HMA off is no way out for a Mamba model (vLLM refuses that
    # itself), so the message must not suggest it.
    assert "disable-hybrid-kv-cache-manager" not in message


def test_mamba_hybrid_with_hma_off_is_refused_by_vllm():
    """No configuration runs a Mamba hybrid with LMCache: with HMA off vLLM
    cannot put the Mamba and attention layers into one group."""
    vllm_config = layouts.layout_vllm_config(layouts.mamba_hybrid(), hma=False)
    with pytest.raises(ValueError, match="failed to convert"):
        layouts.kv_cache_configs(layouts.mamba_hybrid(), vllm_config)


@pytest.mark.parametrize("hma", [True, False], ids=["hma", "hma-off"])
def test_layers_with_different_kv_sizes_are_refused_at_start_up(
    kernel, distributed, hma
):
    """Full attention with 2 and 1 KV heads of 64 (a UniformTypeKVCacheSpecs
    group): LMCache's chunks cannot hold both; the workers refuse at start-up
    (the scheduler gets one layer's spec from vLLM and cannot tell)."""
    layout = layouts.uniform_type_mixed_hidden()
    with pytest.raises(ValueError) as exc_info:
        start(layout, hma, KVConnectorRole.WORKER)
    message = str(exc_info.value)
    assert "128 values per token" in message and "64 values per token" in message
    assert "model.layers.1.self_attn.attn" in message
    assert "without LMCache" in message
