"""Stage 09: two real NixlConnectorWorkers (NIXL agents with the UCX backend
on the loopback interface, in this process) move a Mamba hybrid's blocks:
the attention blocks of a P/D hit and, per Mamba KV cache group, the one
state block after it, each layer's conv and SSM state bit-exact.

The KV caches are laid out as vLLM's model runner lays out a Mamba hybrid on
CPU: every layer's block i is page i of its KV cache tensor (an attention
layer's K and V of the block next to each other, a Mamba layer's conv and SSM
states at the start of the page), and each tensor is shared by one layer of
every KV cache group. The layouts are the tiny Bamba-like model of the end to
end runs (``hmastack_testkit.e2e.models``: one attention group and three Mamba
groups, 64-token blocks of 16 KiB) and a larger one (Mamba states of about
1 MiB per layer and block). Each test prints what moved: blocks, bytes, time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import msgspec
import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")


@dataclass(frozen=True)
class Layout:
    name: str
    num_blocks: int
    num_tensors: int  # KV cache tensors, each shared by a layer of every group
    num_mamba_groups: int
    kv_heads: int
    head_size: int
    block_size: int
    conv_shape: tuple[int, int]  # (conv kernel - 1, conv dim)
    ssm_shape: tuple[int, int, int]  # (heads, head dim, state)
    dtype: torch.dtype

    @property
    def page(self) -> int:
        attn = 2 * self.kv_heads * self.block_size * self.head_size
        return attn * self.dtype.itemsize


LAYOUTS = [
    # bamba-like: hidden 64, 2 heads (1 KV head of 32), Mamba-2 with 4 heads of
    # 32, state 16, conv 4: 10112 bytes of state, a 64-token page of 16 KiB.
    Layout("bamba-like", 24, 1, 3, 1, 32, 64, (3, 160), (4, 32, 16), torch.float32),
    # Larger states: 1 MiB pages (attention: 8 KV heads of 128, 256 tokens,
    # bfloat16; Mamba: conv (3, 8448), SSM (32, 64, 128)).
    Layout(
        "1MiB-pages", 20, 2, 1, 8, 128, 256, (3, 8448), (32, 64, 128), torch.bfloat16
    ),
]


@pytest.fixture(scope="module")
def distributed():
    from hmastack_testkit.kvtest import init_one_process_world

    init_one_process_world()
    yield


def _kv_cache_config(layout: Layout):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    groups = [
        KVCacheGroupSpec(
            [f"attn{t}" for t in range(layout.num_tensors)],
            FullAttentionSpec(
                layout.block_size, layout.kv_heads, layout.head_size, layout.dtype
            ),
        )
    ] + [
        KVCacheGroupSpec(
            [f"mamba{g}_{t}" for t in range(layout.num_tensors)],
            MambaSpec(
                block_size=layout.block_size,
                shapes=(layout.conv_shape, layout.ssm_shape),
                dtypes=(layout.dtype, layout.dtype),
                page_size_padded=layout.page,
                mamba_type="mamba2",
            ),
        )
        for g in range(layout.num_mamba_groups)
    ]
    tensors = [
        KVCacheTensor(
            layout.num_blocks * layout.page,
            [g.layer_names[t] for g in groups],
        )
        for t in range(layout.num_tensors)
    ]
    return KVCacheConfig(
        num_blocks=layout.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def _kv_caches(layout: Layout, kv_cache_config, fill: bool):
    """The layers' caches as the model runner makes them for a Mamba hybrid
    (``_reshape_kv_cache_tensors`` and ``_update_hybrid_attention_mamba_layout``),
    and the raw tensors."""
    caches: dict = {}
    raws = []
    n = layout.num_blocks
    for tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        if fill:
            raw.copy_(torch.randint(-128, 128, (tensor.size,), dtype=torch.int8))
        raws.append(raw)
        for name in tensor.shared_by:
            if name.startswith("attn"):
                attn = raw.view(layout.dtype).view(
                    2, n, layout.kv_heads, layout.block_size, layout.head_size
                )
                hidden = attn.shape[2:].numel()
                attn.as_strided_(
                    size=attn.shape, stride=(hidden, 2 * hidden, *attn.stride()[2:])
                )
                caches[name] = attn
                continue
            states, offset = [], 0
            for shape in (layout.conv_shape, layout.ssm_shape):
                size = layout.dtype.itemsize
                stride = torch.empty((n, *shape)).stride()
                states.append(
                    torch.as_strided(
                        raw.view(layout.dtype),
                        size=(n, *shape),
                        stride=(layout.page // size, *stride[1:]),
                        storage_offset=offset // size,
                    )
                )
                offset += stride[0] * size
            assert offset <= layout.page
            caches[name] = states
    return caches, raws


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (compared bit for bit, NaN patterns included)."""
    return tensor.view(torch.uint8)


def _vllm_config(block_size: int):
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="float32"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048, max_model_len=2048, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
        ),
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_mamba_state_blocks_move_bit_exact(distributed, layout: Layout):
    """A consumer reads a hit of 3 attention blocks and, per Mamba group,
    the state block after it (the producer's block 2 of the group) into its
    own blocks: every layer's K and V and every Mamba layer's conv and SSM
    states arrive bit-exact in the paired blocks, whole pages, nothing else
    (the null block untouched)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
        NixlAgentMetadata,
        NixlConnectorMetadata,
        NixlConnectorWorker,
    )

    kv_cache_config = _kv_cache_config(layout)
    vllm_config = _vllm_config(layout.block_size)
    producer = NixlConnectorWorker(vllm_config, "producer", kv_cache_config)
    consumer = NixlConnectorWorker(vllm_config, "consumer", kv_cache_config)
    try:
        src, src_raws = _kv_caches(layout, kv_cache_config, fill=True)
        dst, dst_raws = _kv_caches(layout, kv_cache_config, fill=False)
        producer.register_kv_caches(src)
        consumer.register_kv_caches(dst)
        agent_meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(
            producer.xfer_handshake_metadata.agent_metadata_bytes
        )
        consumer._remote_agents["producer"] = {
            0: consumer.add_remote_agent(agent_meta, remote_tp_rank=0, remote_tp_size=1)
        }
        # The producer's tables: attention blocks 1~3; per Mamba group, its
        # block 2 of 3 (the state after the hit's last token). The consumer
        # reads them into blocks of its own, disjoint across groups.
        num_groups = 1 + layout.num_mamba_groups
        remote = [[1, 2, 3]] + [[4 + 3 * g + 2] for g in range(layout.num_mamba_groups)]
        local = [[layout.num_blocks - 1 - i for i in range(3)]] + [
            [layout.num_blocks - 4 - g] for g in range(layout.num_mamba_groups)
        ]
        assert len(remote) == len(local) == num_groups
        seconds = []
        # The first read also connects the two agents; the second is warm.
        for req_id in ("req0", "req1"):
            metadata = NixlConnectorMetadata()
            metadata.add_new_req_to_recv(
                request_id=req_id,
                local_block_ids=local,
                kv_transfer_params=dict(
                    remote_engine_id="producer",
                    remote_request_id=req_id,
                    remote_host="127.0.0.1",
                    remote_port=0,
                ),
                remote_block_ids=remote,
            )
            start = time.perf_counter()
            consumer.start_load_kv(metadata)
            deadline = time.monotonic() + 60
            done: set[str] = set()
            while req_id not in done and time.monotonic() < deadline:
                done |= consumer.get_finished()[1]
                time.sleep(0.0005)
            seconds.append(time.perf_counter() - start)
            assert req_id in done
        assert not consumer.get_block_ids_with_load_errors()

        pairs = [
            (lb, rb)
            for g in range(num_groups)
            for lb, rb in zip(local[g], remote[g], strict=True)
        ]
        for raw_dst, raw_src in zip(dst_raws, src_raws, strict=True):
            expected = torch.zeros_like(raw_dst).view(layout.num_blocks, layout.page)
            for lb, rb in pairs:
                expected[lb] = raw_src.view(layout.num_blocks, layout.page)[rb]
            assert torch.equal(raw_dst.view(layout.num_blocks, layout.page), expected)
        for g in range(layout.num_mamba_groups):
            (lb,), (rb,) = local[1 + g], remote[1 + g]
            for t in range(layout.num_tensors):
                for got, want in zip(
                    dst[f"mamba{g}_{t}"], src[f"mamba{g}_{t}"], strict=True
                ):
                    assert torch.equal(_bits(got[lb]), _bits(want[rb]))
        for t in range(layout.num_tensors):
            for lb, rb in zip(local[0], remote[0], strict=True):
                got, want = dst[f"attn{t}"][:, lb], src[f"attn{t}"][:, rb]
                assert torch.equal(_bits(got), _bits(want))
        num_pages = len(pairs) * layout.num_tensors
        state_bytes = sum(
            torch.Size(shape).numel() * layout.dtype.itemsize
            for shape in (layout.conv_shape, layout.ssm_shape)
        )
        size = num_pages * layout.page
        print(
            f"\n{layout.name}: {len(pairs)} blocks ({len(local[0])} attention, "
            f"{layout.num_mamba_groups} Mamba state) x {layout.num_tensors} KV "
            f"cache tensors = {num_pages} pages of {layout.page} bytes, "
            f"{size} bytes ({state_bytes} bytes of conv and SSM state per Mamba "
            f"layer and block); first read {seconds[0] * 1e3:.1f} ms, second "
            f"{seconds[1] * 1e3:.1f} ms ({size / seconds[1] / 2**20:.0f} MiB/s)"
        )
    finally:
        consumer.shutdown()
        producer.shutdown()
