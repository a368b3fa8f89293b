"""The sliding-window minimum: how many blocks one sliding-window KV cache
group must hold for the next token to see its whole window (pure Python)."""

from __future__ import annotations


def window_min_blocks(window: int, block_size: int) -> int:
    """``ceil((W - 1) / B) + 1`` blocks: the ``W - 1`` tokens before a token
    and the token itself, where a window that does not start on a block
    boundary spans one block more.

    ``window`` (``W``) and ``block_size`` (``B``) in tokens; the result in
    blocks of one KV cache group. For a request that computes ``n`` new tokens
    after its hit, the bound on one step is ``window_min_blocks(W + n, B)``
    (the window before the first new token, widened by the others). Raises
    ``ValueError`` for a window or block size below 1.
    """
    if window < 1 or block_size < 1:
        raise ValueError(f"window {window} and block size {block_size} must be >= 1")
    return -(-(window - 1) // block_size) + 1
