"""One decoding token of a Mamba-1 layer between in_proj and out_proj, in one call (``kernels/mamba_step.c``).

    x, z     = xz[:, :Dm], xz[:, Dm:]                            xz (B, 2 Dm): in_proj's output for one token
    u        = silu(conv_b + sum_k conv_w[:, k] [conv_state; x]_k)   conv_state (B, K-1, Dm), conv_w (Dm, K)
    dt, B, C = split(u wx^T, [R, N, N])                          wx (R + 2N, Dm): x_proj's weight
    dt       = softplus(dt wdt^T + bdt)                          wdt (Dm, R), bdt (Dm,): dt_proj's
    h'       = exp(-dt exp(A_log)) h + dt B u                    h (B, Dm, N), A_log (Dm, N)
    y        = (C . h' + Dp u) * silu(z)                         -> y (B, Dm), new conv state, h' (B, Dm, N)

The layer's own PyTorch step (``layers.mamba.Mamba.mix`` with ``selective_scan``) is the same math and the
reference: ``mamba_step`` is used by ``Mamba`` only where ``usable`` says (float32 on CPU, one token, no
gradient, a plain single-device sequence, the kernel built). The states passed in are read, never written.
Inside a compiled graph it is the custom op ``subquad::mamba_step``; eagerly the ctypes call itself.
"""

from __future__ import annotations

import ctypes

import torch

from subquad import kernels

_I64, _P = ctypes.c_int64, ctypes.c_void_p


@torch.compiler.disable
def _library():
    lib = kernels.load("mamba_step")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.mamba_step.restype = None
        lib.mamba_step.argtypes = [_I64, _I64, _I64, _I64, _I64, ctypes.c_int, _P, _I64, _P, _P, _P, _P, _P, _I64,
                                   _I64, _P, _P, _P, _P, _P, _P, _P, _P]
        lib._typed = True
    return lib


_BUILT: list[bool] = []            # [whether the kernel loaded], once asked: what a compiled graph reads


def available() -> bool:
    """Whether the kernel is built (building it on the first call) and kernels are on."""
    if not _BUILT:
        _BUILT.append(_library() is not None)
    return _BUILT[0]


def ptr(t):
    return None if t is None else t.data_ptr()


def _run(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    B, D = xz.shape[0], xz.shape[-1] // 2
    N, K, R = A_log.shape[1], conv_w.shape[-1], wdt.shape[1]
    xz = xz.reshape(B, 2 * D)
    if xz.stride(1) != 1:
        xz = xz.contiguous()
    conv_w = conv_w.reshape(D, K).contiguous()
    conv_state, wx, A_log, h = (t.contiguous() for t in (conv_state, wx, A_log, h))
    y, h_out = xz.new_empty(B, D), torch.empty_like(h)
    conv_out = conv_state.new_empty(B, K - 1, D)
    scratch = xz.new_empty(B * (2 * D + wx.shape[0]))
    _library().mamba_step(B, D, N, R, K, torch.get_num_threads(), ptr(xz), xz.stride(0), ptr(conv_state),
                          ptr(conv_w), ptr(conv_b), ptr(wx), ptr(wdt), wdt.stride(0), wdt.stride(1), ptr(bdt),
                          ptr(A_log), ptr(Dp), ptr(h), ptr(y), ptr(conv_out), ptr(h_out), ptr(scratch))
    return y, conv_out, h_out


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("mamba_step(Tensor xz, Tensor conv_state, Tensor conv_w, Tensor? conv_b, Tensor wx, Tensor wdt, "
            "Tensor bdt, Tensor A_log, Tensor Dp, Tensor h) -> (Tensor, Tensor, Tensor)")
_LIB.impl("mamba_step", _run, "CPU")


@torch.library.register_fake("subquad::mamba_step")
def _(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    B, D = xz.shape[0], xz.shape[-1] // 2
    return xz.new_empty(B, D), conv_state.new_empty(B, conv_w.shape[-1] - 1, D), h.new_empty(h.shape)


def usable(x: torch.Tensor, *tensors) -> bool:
    """Whether ``mamba_step`` may take this step: x (B, 1, .) float32 on CPU, every tensor given float32 on CPU,
    no gradient wanted, no autocast (in_proj's output would be bfloat16), and the kernel available."""
    if x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or not kernels.enabled():
        return False
    if not all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors):
        return False
    if torch.compiler.is_compiling():          # traced: only a kernel an eager call has already loaded
        return bool(_BUILT) and _BUILT[0]
    return available()


def mamba_step(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    """(y (B, Dm), new conv state (B, K-1, Dm), new h (B, Dm, N)) of the module doc's step; xz (B, 1, 2 Dm) or
    (B, 2 Dm), conv_w (Dm, 1, K) or (Dm, K)."""
    if torch.compiler.is_compiling():
        return torch.ops.subquad.mamba_step(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h)
    return _run(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h)
