"""Fakes at the Triton boundary: plain-torch reference kernels for Mamba-2 layers.

vLLM 0.13.0's ``MambaMixer2`` (Bamba, Granite 4.0-H, Nemotron-H, Zamba2, Falcon-H1)
runs five Triton kernels: the causal convolution over a prefill
(``causal_conv1d_fn``) and a decode step (``causal_conv1d_update``), the chunked SSD
scan over a prefill (``mamba_chunk_scan_combined_varlen``), the one-step state
update of a decode (``selective_state_update``) and the gated RMSNorm
(``rms_norm_gated``). The CPU platform has no Triton, so the CPU engine cannot run
them. The functions here take the same arguments and keep the same contract (the
same tensors read, the same states written to the same cache blocks, including
the states at ``mamba_block_size`` boundaries that Mamba prefix caching keeps),
computed as a sequential recurrence, one token at a time, in float32.

One more piece of the CPU platform refuses a Mamba layer: on CPU every linear
layer's weight is repacked after loading (``dispatch_cpu_unquantized_gemm``), which
unpacks the weight as a matrix; the Mamba conv1d "linear" holds a
``(dim, 1, width)`` weight that the layer reads only as ``conv_weights`` and never
multiplies as a linear layer. :func:`install` leaves such weights as they are.

:func:`install` puts the fakes in place in the current process (the engine core
runs in-process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); it is idempotent.
Speculative decoding (``num_accepted_tokens``) is not implemented: the fakes raise
``NotImplementedError`` for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1  # vllm.attention.backends.utils.PAD_SLOT_ID

# What install() replaced: (module, name) -> the original.
_ORIGINALS: dict[tuple[str, str], object] = {}


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _softplus(dt: torch.Tensor) -> torch.Tensor:
    """The kernels' softplus: ``log1p(exp(dt))`` below 20, ``dt`` above."""
    return torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)


def _index(indices: torch.Tensor | None, seq: int, col: torch.Tensor | None) -> int:
    """The cache line of sequence ``seq``: ``indices[seq]`` (one state per
    request) or ``indices[seq, col[seq]]`` (prefix caching: one per block)."""
    if indices is None:
        return seq
    if indices.dim() == 1:
        return int(indices[seq])
    return int(indices[seq, 0 if col is None else int(col[seq])])


# --- causal convolution ------------------------------------------------------------


def _conv(full: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """Depthwise causal convolution of ``full`` (dim, width - 1 + n): the n
    outputs, each from the ``width`` inputs ending at its token."""
    width = weight.shape[1]
    n = full.shape[1] - (width - 1)
    out = torch.zeros(full.shape[0], n, dtype=torch.float32)
    w = weight.float()
    for t in range(n):
        out[:, t] = (full[:, t : t + width].float() * w).sum(-1)
    if bias is not None:
        out += bias.float()[:, None]
    if activation in ("silu", "swish", True):
        out = _silu(out)
    return out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int = 0,
    metadata=None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Reference of ``vllm...ops.causal_conv1d.causal_conv1d_fn`` (prefill).

    ``x`` (dim, tokens) holds the sequences back to back (``query_start_loc``).
    Sequence ``i`` starts from the conv state in its cache line when
    ``has_initial_state[i]`` (else zeros) and writes the state after its last
    token; with prefix caching (``block_idx_last_scheduled_token`` given) it reads
    the line at ``initial_state_idx[i]`` of its row of ``cache_indices``, writes
    the final state at ``block_idx_last_scheduled_token[i]`` and the state after
    each ``block_size_to_align`` boundary inside the new tokens at
    ``block_idx_first_scheduled_token[i]`` onwards.
    """
    width = weight.shape[1]
    state_len = width - 1
    out = torch.zeros(x.shape, dtype=torch.float32)
    apc = block_idx_last_scheduled_token is not None
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        begin, end = starts[seq], starts[seq + 1]
        if end <= begin:
            continue
        line_in = _index(cache_indices, seq, initial_state_idx if apc else None)
        if line_in == pad_slot_id:
            continue
        if has_initial_state is not None and bool(has_initial_state[seq]):
            history = conv_states[line_in, :, :state_len].float()
        else:
            history = torch.zeros(x.shape[0], state_len)
        full = torch.cat([history, x[:, begin:end].float()], dim=1)
        out[:, begin:end] = _conv(full, weight, bias, activation)
        line_out = _index(
            cache_indices, seq, block_idx_last_scheduled_token if apc else None
        )
        conv_states[line_out, :, :state_len] = full[:, -state_len:].to(
            conv_states.dtype
        )
        if not apc:
            continue
        first = int(block_idx_first_scheduled_token[seq])
        last = int(block_idx_last_scheduled_token[seq])
        computed = int(num_computed_tokens[seq])
        for block in range(first, last):
            # the state after the block's last token: the inputs before its end
            boundary = (block + 1) * block_size_to_align - computed
            line = int(cache_indices[seq, block])
            conv_states[line, :, :state_len] = full[
                :, boundary : boundary + state_len
            ].to(conv_states.dtype)
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_SLOT_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Reference of ``vllm...ops.causal_conv1d.causal_conv1d_update`` (decode).

    ``x`` is (batch, dim) or (batch, dim, seqlen); each sequence reads the conv
    state of its line (``initial_state_idx`` with prefix caching), and writes the
    shifted state to its line (``block_idx_last_scheduled_token`` with prefix
    caching). Writes the output into ``x`` and returns it, as the kernel does.
    """
    if num_accepted_tokens is not None or query_start_loc is not None:
        raise NotImplementedError(
            "the reference causal_conv1d_update has no speculative decoding "
            "(num_accepted_tokens) and no varlen input (query_start_loc)"
        )
    width = weight.shape[1]
    state_len = width - 1
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    apc = block_idx_last_scheduled_token is not None
    for seq in range(xs.shape[0]):
        line_in = _index(conv_state_indices, seq, initial_state_idx if apc else None)
        if line_in == pad_slot_id:
            continue
        line_out = _index(
            conv_state_indices, seq, block_idx_last_scheduled_token if apc else None
        )
        history = conv_state[line_in, :, :state_len].float()
        full = torch.cat([history, xs[seq].float()], dim=1)
        result = _conv(full, weight, bias, activation)
        conv_state[line_out, :, :state_len] = full[:, -state_len:].to(conv_state.dtype)
        xs[seq] = result.to(xs.dtype)
    return x


# --- selective state space ---------------------------------------------------------


def _ssm_step(state, x, dt, A, B, C, D):
    """One token of every head: ``state`` (nheads, headdim, dstate) float32,
    ``x``/``dt`` (nheads, headdim), ``A`` (nheads, headdim, dstate), ``B``/``C``
    (nheads, dstate) (the head's group), ``D`` (nheads, headdim) or None.
    Returns the new state and the output (nheads, headdim)."""
    state = state * torch.exp(A * dt[..., None]) + (dt * x)[..., None] * B[:, None, :]
    y = (state * C[:, None, :]).sum(-1)
    if D is not None:
        y = y + D * x
    return state, y


def selective_state_update(
    state,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    state_batch_indices=None,
    dst_state_batch_indices=None,
    pad_slot_id=PAD_SLOT_ID,
    out=None,
    num_accepted_tokens=None,
    cu_seqlens=None,
):
    """Reference of ``vllm...ops.mamba_ssm.selective_state_update`` (decode):
    one token per sequence, from the state at ``state_batch_indices`` to the
    one at ``dst_state_batch_indices`` (the same line when not given)."""
    if num_accepted_tokens is not None or cu_seqlens is not None:
        raise NotImplementedError(
            "the reference selective_state_update has no speculative decoding "
            "(num_accepted_tokens, cu_seqlens)"
        )
    if state.dim() == 3:
        state = state.unsqueeze(1)
    x = x if x.dim() == 3 else x.unsqueeze(1)
    dt = dt if dt.dim() == 3 else dt.unsqueeze(1)
    A = A if A.dim() == 3 else A.unsqueeze(0)
    B = B if B.dim() == 3 else B.unsqueeze(1)
    C = C if C.dim() == 3 else C.unsqueeze(1)
    if D is not None and D.dim() == 1:
        D = D.unsqueeze(0)
    if z is not None and z.dim() == 2:
        z = z.unsqueeze(1)
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias.unsqueeze(0)
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    if dst_state_batch_indices is None:
        dst_state_batch_indices = state_batch_indices
    nheads = state.shape[1]
    per_group = nheads // B.shape[1]
    for seq in range(x.shape[0]):
        line_in = _index(state_batch_indices, seq, None)
        if line_in == pad_slot_id:
            continue
        line_out = _index(dst_state_batch_indices, seq, None)
        d = dt[seq].float()
        if dt_bias is not None:
            d = d + dt_bias.float()
        if dt_softplus:
            d = _softplus(d)
        Bh = B[seq].float().repeat_interleave(per_group, dim=0)
        Ch = C[seq].float().repeat_interleave(per_group, dim=0)
        new, y = _ssm_step(
            state[line_in].float(),
            x[seq].float(),
            d,
            A.float().expand(nheads, *A.shape[1:]),
            Bh,
            Ch,
            None if D is None else D.float(),
        )
        if z is not None:
            y = y * _silu(z[seq].float())
        if line_out != pad_slot_id:
            state[line_out] = new.to(state.dtype)
        out3[seq] = y.to(out3.dtype)
    return out


def mamba_chunk_scan_combined_varlen(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    cu_seqlens,
    cu_chunk_seqlens,
    last_chunk_indices,
    seq_idx,
    out,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_intermediate_states=False,
    state_dtype=None,
):
    """Reference of ``vllm...ops.ssd_combined.mamba_chunk_scan_combined_varlen``
    (prefill): the SSM over each sequence of ``x`` (tokens, nheads, headdim),
    from ``initial_states[i]`` (else zeros), output written into ``out``.
    Returns the state after each logical chunk of ``cu_chunk_seqlens``
    (``return_intermediate_states``) or after each sequence's last chunk."""
    tokens, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    per_group = nheads // ngroups
    chunk_ends = cu_chunk_seqlens.tolist()[1:]
    chunk_seqs = seq_idx.tolist()
    states = torch.zeros(len(chunk_ends), nheads, headdim, dstate)
    Ah = A.float()[:, None, None].expand(nheads, headdim, dstate)
    starts = cu_seqlens.tolist()
    chunk = 0
    for seq in range(len(starts) - 1):
        begin, end = starts[seq], starts[seq + 1]
        if initial_states is not None:
            h = initial_states[seq].float().clone()
        else:
            h = torch.zeros(nheads, headdim, dstate)
        for t in range(begin, end):
            d = dt[t].float()
            if dt_bias is not None:
                d = d + dt_bias.float()
            if dt_softplus:
                d = _softplus(d)
            d = d.clamp(dt_limit[0], dt_limit[1])
            d = d[:, None].expand(nheads, headdim)
            Bh = B[t].float().repeat_interleave(per_group, dim=0)
            Ch = C[t].float().repeat_interleave(per_group, dim=0)
            Dh = None
            if D is not None:
                Dh = D.float() if D.dim() == 2 else D.float()[:, None]
            h, y = _ssm_step(h, x[t].float(), d, Ah, Bh, Ch, Dh)
            if z is not None:
                y = y * _silu(z[t].float())
            out[t] = y.to(out.dtype)
            while chunk < len(chunk_ends) and chunk_ends[chunk] == t + 1:
                if chunk_seqs[chunk] != seq:
                    raise ValueError(
                        f"chunk {chunk} ends at token {t + 1} of sequence {seq} "
                        f"but seq_idx names sequence {chunk_seqs[chunk]}"
                    )
                states[chunk] = h
                chunk += 1
    dtype = state_dtype if state_dtype is not None else C.dtype
    states = states.to(dtype)
    if return_intermediate_states:
        return states
    return states[last_chunk_indices.long()]


def rms_norm_gated(
    x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True
):
    """Reference of ``vllm...ops.layernorm_gated.rms_norm_gated``."""
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    size = xf.shape[-1] if group_size is None else group_size
    grouped = xf.reshape(*xf.shape[:-1], xf.shape[-1] // size, size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    y = grouped.reshape(xf.shape) * weight.float()
    if bias is not None:
        y = y + bias.float()
    if z is not None and norm_before_gate:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


# --- the CPU platform's linear repacking -------------------------------------------


def _leave_non_matrix_weights(original):
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool):
        if layer.weight.dim() != 2:
            # Mamba's conv1d: read as conv_weights, never run as a linear layer
            layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
            return None
        return original(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


# --- the Mamba metadata builder on a platform without CUDA graphs ------------------


def _no_cudagraph_sizes(original_init):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        compilation = vllm_config.compilation_config
        if compilation.max_cudagraph_capture_size is None:
            # CpuPlatform captures no CUDA graph: no decode batch is padded
            compilation.max_cudagraph_capture_size = 0
        original_init(self, kv_cache_spec, layer_names, vllm_config, device)

    __init__.__wrapped__ = original_init
    return __init__


# --- install -----------------------------------------------------------------------

MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
KERNELS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "selective_state_update",
    "mamba_chunk_scan_combined_varlen",
    "rms_norm_gated",
)


def _replace(module, name: str, value) -> None:
    key = (module.__name__, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(module, name)
    setattr(module, name, value)


def install() -> None:
    """Put the reference kernels in place of the Triton ones that
    ``MambaMixer2`` calls, and let the CPU platform load its conv1d weight."""
    import importlib

    from vllm.attention.backends import utils as backend_utils
    from vllm.model_executor.layers import utils as layer_utils

    if backend_utils.PAD_SLOT_ID != PAD_SLOT_ID:
        raise RuntimeError(
            f"vLLM's PAD_SLOT_ID is {backend_utils.PAD_SLOT_ID}, the reference "
            f"kernels assume {PAD_SLOT_ID}"
        )
    mixer2 = importlib.import_module(MIXER2)
    for name in KERNELS:
        _replace(mixer2, name, globals()[name])
    from vllm.v1.attention.backends import mamba_attn

    builder = mamba_attn.BaseMambaAttentionMetadataBuilder
    init = builder.__init__
    if not hasattr(init, "__wrapped__"):
        builder.__init__ = _no_cudagraph_sizes(init)
    key = (layer_utils.__name__, "dispatch_cpu_unquantized_gemm")
    original = _ORIGINALS.get(key, layer_utils.dispatch_cpu_unquantized_gemm)
    _replace(
        layer_utils,
        "dispatch_cpu_unquantized_gemm",
        _leave_non_matrix_weights(original),
    )
