"""Stage 0: the environment the whole matrix stands on.

These run in the pinned CPU environment with the stage's vLLM tree on
PYTHONPATH: vLLM resolves the CPU platform through our plugin, hub model ids
resolve offline, and the two hybrid layer patterns our tests use produce a
full-attention and a sliding-window KV cache group.
"""

from __future__ import annotations

import os

import pytest


def test_platform_is_cpu_through_the_plugin():
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "CpuPlatform"


def test_hub_is_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize(
    ("model", "window", "sliding_per_full"),
    [("hmastack/gemma3-like-text", 512, 5), ("hmastack/gpt-oss-like", 128, 1)],
)
def test_hybrid_layer_patterns_resolve_offline(model, window, sliding_per_full):
    from vllm.config import ModelConfig

    config = ModelConfig(model=model, dtype="bfloat16", skip_tokenizer_init=True)
    hf = config.hf_text_config
    assert hf.sliding_window == window
    kinds = hf.layer_types
    assert kinds.count("sliding_attention") == sliding_per_full * kinds.count(
        "full_attention"
    )
    assert config.get_sliding_window() == window


def test_opt_125m_resolves_offline_with_its_tokenizer():
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig

    config = ModelConfig(model="facebook/opt-125m", dtype="float16")
    assert config.hf_config.num_hidden_layers == 12
    assert config.max_model_len == 2048
    tokenizer = AutoTokenizer.from_pretrained("facebook/opt-125m")
    ids = tokenizer.encode("hello KV cache", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello KV cache"
