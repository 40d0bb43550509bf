"""One decoding token of a Mamba-1 layer between in_proj and out_proj, in one call (``kernels/mamba_step.c``).

    x, z     = xz[:, :Dm], xz[:, Dm:]                            xz (B, 2 Dm): in_proj's output for one token
    u        = silu(conv_b + sum_k conv_w[:, k] [conv_state; x]_k)   conv_state (B, K-1, Dm), conv_w (Dm, K)
    dt, B, C = split(u wx^T, [R, N, N])                          wx (R + 2N, Dm): x_proj's weight
               (Zamba's heads: wx (heads, R + 2N, Dm / heads), each head's own dt, B, C from its own channels)
    dt       = softplus(dt wdt^T + bdt)                          wdt (Dm, R), bdt (Dm,): dt_proj's
    h'       = exp(-dt exp(A_log)) h + dt B u                    h (B, Dm, N), A_log (Dm, N)
    y        = (C . h' + Dp u) * silu(z)                         -> y (B, Dm), new conv state, h' (B, Dm, N)

The layer's own PyTorch step (``layers.mamba.Mamba.mix`` with ``selective_scan``) is the same math and the
reference: ``mamba_step`` is used by ``Mamba`` only where ``kernels.usable`` says (float32 on CPU, one token,
no gradient, no autocast, the kernel built) and the sequence is a plain single-device one. The states passed
in are read, never written. Inside a compiled graph it is the custom op ``subquad::mamba_step``; eagerly the
ctypes call itself.
"""

from __future__ import annotations

import torch

from subquad.kernels import I64, INT, PTR, Kernel

KERNEL = Kernel("mamba_step", [I64, I64, I64, I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, I64, I64, PTR,
                               PTR, PTR, PTR, PTR, PTR, PTR, PTR])


def prepare_weights(conv_w, wx, wdt, bdt, A_log):
    """The layer's weights as the kernel reads them -> (conv_w (D, K), wx, wdt (D, R), bdt (D,), A_log, (N, K, R,
    heads)); each contiguous where the kernel needs it (a view where it already is)."""
    D, N, K, R = A_log.shape[0], A_log.shape[1], conv_w.shape[-1], wdt.shape[-1]
    heads = wx.shape[0] if wx.dim() == 3 else 1
    wx, A_log, bdt = (t.contiguous() for t in (wx, A_log, bdt.reshape(D)))
    return conv_w.reshape(D, K).contiguous(), wx, wdt.reshape(D, R), bdt, A_log, (N, K, R, heads)


def prepare(conv_state, conv_w, wx, wdt, bdt, A_log, h):
    """``prepare_weights`` and the states, contiguous -> (conv_state, conv_w, wx, wdt, bdt, A_log, h, (N, K, R,
    heads))."""
    conv_w, wx, wdt, bdt, A_log, sizes = prepare_weights(conv_w, wx, wdt, bdt, A_log)
    return conv_state.contiguous(), conv_w, wx, wdt, bdt, A_log, h.contiguous(), sizes


def _run(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    B, D = xz.shape[0], xz.shape[-1] // 2
    xz = xz.reshape(B, 2 * D)
    if xz.stride(1) != 1:
        xz = xz.contiguous()
    conv_state, conv_w, wx, wdt, bdt, A_log, h, (N, K, R, heads) = prepare(conv_state, conv_w, wx, wdt, bdt, A_log, h)
    y, h_out = xz.new_empty(B, D), torch.empty_like(h)
    conv_out = conv_state.new_empty(B, K - 1, D)
    scratch = xz.new_empty(B * (2 * D + heads * (R + 2 * N)))
    KERNEL(B, D, N, R, K, heads, torch.get_num_threads(), xz, xz.stride(0), conv_state, conv_w, conv_b, wx, wdt,
           wdt.stride(0), wdt.stride(1), bdt, A_log, Dp, h, y, conv_out, h_out, scratch)
    return y, conv_out, h_out


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("mamba_step(Tensor xz, Tensor conv_state, Tensor conv_w, Tensor? conv_b, Tensor wx, Tensor wdt, "
            "Tensor bdt, Tensor A_log, Tensor Dp, Tensor h) -> (Tensor, Tensor, Tensor)")
_LIB.impl("mamba_step", _run, "CPU")


@torch.library.register_fake("subquad::mamba_step")
def _(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    B, D = xz.shape[0], xz.shape[-1] // 2
    return xz.new_empty(B, D), conv_state.new_empty(B, conv_w.shape[-1] - 1, D), h.new_empty(h.shape)


def mamba_step(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    """(y (B, Dm), new conv state (B, K-1, Dm), new h (B, Dm, N)) of the module doc's step; xz (B, 1, 2 Dm) or
    (B, 2 Dm), conv_w (Dm, 1, K) or (Dm, K); with heads, wdt (heads, Dm / heads, R) and bdt (heads, Dm / heads)."""
    if torch.compiler.is_compiling():
        return torch.ops.subquad.mamba_step(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h)
    return _run(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h)
