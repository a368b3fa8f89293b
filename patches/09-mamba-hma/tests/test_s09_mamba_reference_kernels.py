"""Stage 09: the reference kernels that stand in for vLLM's Mamba-2 Triton
kernels on CPU (``hmastack_testkit.mamba_reference_kernels``), checked against
a straightforward whole-sequence recurrence written here.

The fakes are driven as ``MambaMixer2`` drives the kernels: sequences back to
back (varlen), a prefill split in chunks that start from the cached state,
Mamba prefix caching (one state per ``mamba_block_size`` block, read and
written through block indices), decode steps one token at a time, and padded
batch entries. Every output and every state written to a cache block must be
the oracle's: the state after the block's last token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hmastack_testkit import mamba_reference_kernels as ref

DIM = 12  # conv channels
WIDTH = 4  # conv kernel
HEADS, HEAD_DIM, STATE, GROUPS = 4, 3, 5, 2
BLOCK = 8  # mamba_block_size
CHUNK = 4  # the SSD chunk (a divisor of BLOCK)
NUM_LINES = 40  # cache lines (blocks)


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        conv_w=torch.randn(DIM, WIDTH, generator=g),
        conv_b=torch.randn(DIM, generator=g),
        A=-torch.rand(HEADS, generator=g) - 0.1,
        D=torch.randn(HEADS, generator=g),
        dt_bias=torch.randn(HEADS, generator=g),
    )


def oracle_conv(x: torch.Tensor, w, b) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Causal depthwise conv + SiLU over a whole sequence (dim, T) with
    ``F.conv1d``; the conv state (last WIDTH - 1 inputs) after each token."""
    out = F.silu(F.conv1d(x[None], w[:, None, :], b, padding=WIDTH - 1, groups=DIM))
    padded = torch.cat([torch.zeros(DIM, WIDTH - 1), x], dim=1)
    states = [padded[:, t + 1 : t + WIDTH] for t in range(x.shape[1])]
    return out[0, :, : x.shape[1]], states


def oracle_ssm(x, dt, B, C, p) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, one
    token at a time from zero, dt_t = softplus(dt_t + dt_bias); the state
    after each token."""
    h = torch.zeros(HEADS, HEAD_DIM, STATE)
    ys, hs = [], []
    for t in range(x.shape[0]):
        d = F.softplus(dt[t] + p["dt_bias"])
        for head in range(HEADS):
            group = head // (HEADS // GROUPS)
            h[head] = torch.exp(p["A"][head] * d[head]) * h[head] + d[
                head
            ] * torch.outer(x[t, head], B[t, group])
        y = torch.einsum("hps,hs->hp", h, C[t].repeat_interleave(HEADS // GROUPS, 0))
        ys.append(y + p["D"][:, None] * x[t])
        hs.append(h.clone())
    return torch.stack(ys), hs


def _inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    return (
        torch.randn(DIM, T, generator=g),
        torch.randn(T, HEADS, HEAD_DIM, generator=g),
        torch.randn(T, HEADS, generator=g),
        torch.randn(T, GROUPS, STATE, generator=g),
        torch.randn(T, GROUPS, STATE, generator=g),
    )


def _chunk_metadata(computed: list[int], new: list[int]):
    """cu_chunk_seqlens / seq_idx / last_chunk_indices as vLLM's Mamba2
    metadata builder makes them: chunks never cross a sequence nor a CHUNK
    boundary of the sequence's own positions."""
    cu, seq_idx, last = [0], [], []
    for i, (c, n) in enumerate(zip(computed, new, strict=True)):
        pos = c
        while pos < c + n:
            take = min(CHUNK - pos % CHUNK, c + n - pos)
            cu.append(cu[-1] + take)
            seq_idx.append(i)
            pos += take
        last.append(len(seq_idx) - 1)
    return (
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(seq_idx, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32),
    )


class Cache:
    """Conv and SSM state lines, as vLLM's Mamba layer cache: the conv state
    stored (lines, WIDTH - 1, DIM) and read transposed."""

    def __init__(self):
        self.conv_store = torch.zeros(NUM_LINES, WIDTH - 1, DIM)
        self.conv = self.conv_store.transpose(-1, -2)
        self.ssm = torch.zeros(NUM_LINES, HEADS, HEAD_DIM, STATE)


def _prefill(cache, p, seqs, tables):
    """One prefill step of several sequences with prefix caching: ``seqs`` is
    a list of (x, xh, dt, B, C, computed, new) slices, ``tables`` the block
    table of each. Writes what MambaMixer2 writes; returns the conv outputs
    and SSM outputs per sequence."""
    computed = [s[5] for s in seqs]
    new = [s[6] for s in seqs]
    qsl = torch.tensor(
        [0] + list(torch.cumsum(torch.tensor(new), 0)), dtype=torch.int32
    )
    x = torch.cat([s[0] for s in seqs], dim=1)
    table = torch.tensor(tables, dtype=torch.int32)
    c = torch.tensor(computed, dtype=torch.int32)
    seq_lens = c + torch.tensor(new, dtype=torch.int32)
    last_computed = ((c + BLOCK - 1) // BLOCK - 1).clamp(min=0)
    first_sched = (c + 1 + BLOCK - 1) // BLOCK - 1
    last_sched = ((seq_lens + BLOCK - 1) // BLOCK - 1).clamp(min=0)
    has_init = c > 0
    conv_out = ref.causal_conv1d_fn(
        x,
        p["conv_w"],
        p["conv_b"],
        conv_states=cache.conv,
        query_start_loc=qsl,
        cache_indices=table,
        has_initial_state=has_init,
        activation="silu",
        block_idx_first_scheduled_token=first_sched,
        block_idx_last_scheduled_token=last_sched,
        initial_state_idx=last_computed,
        num_computed_tokens=c,
        block_size_to_align=BLOCK,
    )
    xh = torch.cat([s[1] for s in seqs])
    init_lines = table.gather(1, last_computed[:, None])[:, 0]
    initial = torch.where(
        has_init[:, None, None, None], cache.ssm[init_lines.long()], 0
    )
    cu, seq_idx, last_chunk = _chunk_metadata(computed, new)
    out = torch.empty_like(xh)
    states = ref.mamba_chunk_scan_combined_varlen(
        xh,
        torch.cat([s[2] for s in seqs]),
        p["A"],
        torch.cat([s[3] for s in seqs]),
        torch.cat([s[4] for s in seqs]),
        chunk_size=CHUNK,
        cu_seqlens=qsl,
        cu_chunk_seqlens=cu,
        last_chunk_indices=last_chunk,
        seq_idx=seq_idx,
        out=out,
        D=p["D"],
        dt_bias=p["dt_bias"],
        initial_states=initial,
        dt_softplus=True,
        return_intermediate_states=True,
    )
    # MambaMixer2's writes of the states at block boundaries and at the end.
    stride = BLOCK // CHUNK
    for i in range(len(seqs)):
        n_fill = int(last_sched[i] - first_sched[i])
        if n_fill:
            first_chunk = 0 if i == 0 else int(last_chunk[i - 1]) + 1
            first_aligned = first_chunk + stride - 1
            first_aligned -= (int(c[i]) % BLOCK) // CHUNK
            lines = table[i, int(first_sched[i]) : int(last_sched[i])].long()
            cache.ssm[lines] = states[
                first_aligned : first_aligned + n_fill * stride : stride
            ]
    cache.ssm[table.gather(1, last_sched[:, None])[:, 0].long()] = states[
        last_chunk.long()
    ]
    return conv_out, out, qsl


def _decode(cache, p, toks, tables, computed):
    """One decode step of several sequences (one token each), as
    MambaMixer2's decode path calls the two update kernels."""
    table = torch.tensor(tables, dtype=torch.int32)
    c = torch.tensor(computed, dtype=torch.int32)
    last_computed = ((c + BLOCK - 1) // BLOCK - 1).clamp(min=0)
    last_sched = (c + 1 + BLOCK - 1) // BLOCK - 1
    x = torch.stack([t[0] for t in toks])
    conv_out = ref.causal_conv1d_update(
        x.clone(),
        cache.conv,
        p["conv_w"],
        p["conv_b"],
        "silu",
        conv_state_indices=table,
        block_idx_last_scheduled_token=last_sched,
        initial_state_idx=last_computed,
    )
    xh = torch.stack([t[1] for t in toks])
    dt = torch.stack([t[2] for t in toks])[:, :, None].expand(-1, -1, HEAD_DIM)
    out = torch.empty_like(xh)
    ref.selective_state_update(
        cache.ssm,
        xh,
        dt,
        p["A"][:, None, None].expand(-1, HEAD_DIM, STATE),
        torch.stack([t[3] for t in toks]),
        torch.stack([t[4] for t in toks]),
        p["D"][:, None].expand(-1, HEAD_DIM),
        dt_bias=p["dt_bias"][:, None].expand(-1, HEAD_DIM),
        dt_softplus=True,
        state_batch_indices=table.gather(1, last_computed[:, None])[:, 0],
        dst_state_batch_indices=table.gather(1, last_sched[:, None])[:, 0],
        out=out,
    )
    return conv_out, out


@pytest.mark.parametrize("chunks", [[24], [5, 11, 8], [8, 8, 8], [3, 13, 8]])
def test_prefill_chunks_and_decode_match_the_recurrence(chunks: list[int]):
    """Two sequences (24 and 19 prompt tokens) prefilled together in the
    given chunks, then 5 decode steps: the conv and SSM outputs of every
    token, and the state in every block of each table (the state after the
    block's last token; the last block: after the last token), are the
    whole-sequence recurrence's."""
    p = _params()
    lengths = [24, 19]
    total = [n + 5 for n in lengths]
    inputs = [_inputs(t, seed) for seed, t in enumerate(total)]
    oracle = []
    for x, xh, dt, B, C in inputs:
        conv, conv_states = oracle_conv(x, p["conv_w"], p["conv_b"])
        y, ssm_states = oracle_ssm(xh, dt, B, C, p)
        oracle.append((conv, conv_states, y, ssm_states))
    tables = [list(range(1, 6)), list(range(10, 15))]
    cache = Cache()
    done = [0, 0]
    got_conv = [[], []]
    got_y = [[], []]
    for step_chunk in chunks:
        seqs, idx = [], []
        for i in range(2):
            n = min(step_chunk, lengths[i] - done[i])
            if n <= 0:
                continue
            x, xh, dt, B, C = inputs[i]
            a, b = done[i], done[i] + n
            seqs.append((x[:, a:b], xh[a:b], dt[a:b], B[a:b], C[a:b], a, n))
            idx.append(i)
        conv_out, y, qsl = _prefill(cache, p, seqs, [tables[i] for i in idx])
        for j, i in enumerate(idx):
            a, b = int(qsl[j]), int(qsl[j + 1])
            got_conv[i].append(conv_out[:, a:b])
            got_y[i].append(y[a:b])
            done[i] += seqs[j][6]
    for _ in range(5):
        toks = []
        for i in range(2):
            x, xh, dt, B, C = inputs[i]
            t = done[i]
            toks.append((x[:, t], xh[t], dt[t], B[t], C[t]))
        conv_out, y = _decode(cache, p, toks, tables, done)
        for i in range(2):
            got_conv[i].append(conv_out[i][:, None])
            got_y[i].append(y[i][None])
            done[i] += 1
    for i in range(2):
        conv, conv_states, y, ssm_states = oracle[i]
        torch.testing.assert_close(torch.cat(got_conv[i], dim=1), conv)
        torch.testing.assert_close(torch.cat(got_y[i]), y)
        n = total[i]
        for block, line in enumerate(tables[i]):
            end = min((block + 1) * BLOCK, n)
            if block * BLOCK >= n:
                break
            torch.testing.assert_close(
                cache.ssm[line], ssm_states[end - 1], msg=f"seq {i} block {block}"
            )
            torch.testing.assert_close(
                cache.conv[line], conv_states[end - 1], msg=f"seq {i} block {block}"
            )


def test_padded_entries_are_skipped():
    """A batch entry whose cache line is the pad slot is neither read nor
    written."""
    p = _params()
    cache = Cache()
    before = cache.ssm.clone()
    x, xh, dt, B, C = _inputs(1, 0)
    out = torch.zeros(1, HEADS, HEAD_DIM)
    ref.selective_state_update(
        cache.ssm,
        xh,
        dt[:, :, None].expand(-1, -1, HEAD_DIM),
        p["A"][:, None, None].expand(-1, HEAD_DIM, STATE),
        B,
        C,
        p["D"][:, None].expand(-1, HEAD_DIM),
        dt_bias=p["dt_bias"][:, None].expand(-1, HEAD_DIM),
        dt_softplus=True,
        state_batch_indices=torch.tensor([ref.PAD_SLOT_ID], dtype=torch.int32),
        out=out,
    )
    assert torch.equal(cache.ssm, before)


def test_speculative_decoding_is_refused():
    """The fakes implement no speculative decoding: a clear error."""
    with pytest.raises(NotImplementedError, match="speculative"):
        ref.causal_conv1d_update(
            torch.zeros(1, DIM),
            torch.zeros(2, DIM, WIDTH - 1),
            torch.zeros(DIM, WIDTH),
            num_accepted_tokens=torch.ones(1, dtype=torch.int32),
        )
