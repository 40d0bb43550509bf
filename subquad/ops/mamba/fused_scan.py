"""The selective scan over whole prompts in one call (``kernels/mamba_scan.c``): the recurrent form's token loop
with the D skip and the z gate, float32 on CPU without gradients (a prefill).

    h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t        x, dt, z (Bz, T, D); A (D, N) <= 0; B, C (Bz, T, N)
    y_t = (C_t . h_t + D x_t) * silu(z_t)            D (D,) and z optional; h_0 = initial_state (Bz, D, N) or 0
    dt_t = softplus(dt_t + dt_bias)                  with ``softplus``; dt_bias (D,) optional (mamba_ssm's
                                                     delta_bias and delta_softplus: no pass over dt before)

-> (y (Bz, T, D), h_T (Bz, D, N)). S packed prompts (``cu_seqlens`` (S + 1,), x ... z (1, T, .)): each from its
own row of initial_state, h_T (S, D, N), read in place - no copies into a batch. The recurrent form
(``ops.mamba.recurrent``) is the reference and runs wherever this does not (``usable``). Why a kernel: the
chunked form materialises exp(dt A) for every token, channel and state entry (Bz T D N floats, ~50 M for 16
prompts of 128 tokens at mamba-130m's width) and reads it back through einsums; the loop keeps each channel
block's states in L1 and exponentiates as it goes (benchmarks/RESULTS.md, "The selective scan of a prompt in C").
The inputs are read, never written.
"""

from __future__ import annotations

import torch

from subquad.kernels import I64, INT, PTR, Kernel, prompt_usable

KERNEL = Kernel("mamba_scan", [I64, I64, I64, I64, INT, PTR, I64, I64, PTR, I64, I64, PTR, INT, PTR, I64, I64, PTR,
                               I64, I64, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR])


def usable(x, dt, A, B, C, D=None, z=None, initial_state=None, dt_bias=None) -> bool:
    """Whether ``scan`` may run (``kernels.prompt_usable``): every tensor float32 on CPU, x, dt, z, B and C with
    unit stride along their last axis, no gradient wanted, no autocast, kernels on and built, not while tracing."""
    return prompt_usable(KERNEL, (x, dt, A, B, C, D, z, initial_state, dt_bias), (x, dt, B, C, z))


def scan(x, dt, A, B, C, D=None, z=None, initial_state=None, every=False, dt_bias=None, softplus=False,
         cu_seqlens=None):
    """The module doc's scan (``usable`` must hold) -> (y, h_T), or with ``every`` (y, the state after each token
    (Bz, T, D, N)): a speculative verification's (``layers.rollback.PerToken``). ``cu_seqlens``: packed prompts
    in x's one row, already checked (``ops.common.varlen.seq_lengths``)."""
    Bz, T, Dm = x.shape
    N = A.shape[1]
    A = A.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    D = None if D is None else D.contiguous()
    bias = None if dt_bias is None else dt_bias.contiguous()
    seg = None if cu_seqlens is None else cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    rows = Bz if seg is None else seg.numel() - 1
    y, h = x.new_empty(Bz, T, Dm), x.new_empty(rows, Dm, N)
    hs = x.new_empty(Bz, T, Dm, N) if every else None
    zs = (0, 0) if z is None else (z.stride(0), z.stride(1))
    KERNEL(rows, T, Dm, N, torch.get_num_threads(), x, x.stride(0), x.stride(1), dt, dt.stride(0), dt.stride(1),
           bias, int(softplus), z, *zs, B, B.stride(0), B.stride(1), C, C.stride(0), C.stride(1), A, D, h0, y, h,
           hs, seg)
    return (y, hs) if every else (y, h)
