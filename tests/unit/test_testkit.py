"""support/testkit's pure-Python helpers (the vLLM-side ones run in the stage
tests and the bench scenarios)."""

from __future__ import annotations

import pytest
from hmastack_testkit.window import window_min_blocks


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("window", [1, 2, 15, 16, 17, 32, 33, 512])
def test_window_min_blocks_is_the_most_blocks_a_window_spans(window, block_size):
    """The formula against counting: the W tokens ending at token t (the
    token and the W - 1 before it) touch this many blocks at worst, over every
    alignment of t in its block."""
    spans = [
        len({pos // block_size for pos in range(t - window + 1, t + 1)})
        for t in range(window - 1, window - 1 + block_size)
    ]
    assert window_min_blocks(window, block_size) == max(spans)


def test_window_min_blocks_refuses_an_empty_window():
    with pytest.raises(ValueError, match="window 0"):
        window_min_blocks(0, 16)
