"""One decoding token of a (Gated) DeltaNet layer between its input products and o_proj, in one call
(``kernels/delta_step.c``).

    q, k, v = split(silu(sum_j conv_w[:, j] [conv_state; (q, k, v)]_j), [Hk K, Hk K, H V])   conv_w (C, W)
    q, k    = l2(q), l2(k) per key head        (qk_eps None: x / max(|x|, 1e-12); else x rsqrt(|x|^2 + qk_eps))
    beta    = sigmoid(b) (2 sigmoid(b) with neg_eigval)                          b (B, H)
    a       = exp(-exp(A_log) softplus(a_raw + dt_bias))  (Gated DeltaNet; else 1)  a_raw (B, H)
    S'_h    = a S_h + k (beta (v - a S_h^T k))^T          S (B, H, K, V), key head h / (H / Hk)
    o_h     = rmsnorm(scale S'_h^T q) * norm_w            (gated: * act(gate + gate_bias), gate (B, H V);
                                                          act silu, or sigmoid with gate_sigmoid)

-> (o (B, H V), new conv state (B, W-1, C), S' (B, H, K, V)). ``layers.deltanet.DeltaNet.mix`` with
``delta_rule`` / ``gated_delta_rule`` is the same math and the reference; it runs wherever ``kernels.usable``
says no. The states passed in are read, never written. A custom op ``subquad::delta_step`` inside a compiled
graph; eagerly the ctypes call itself.
"""

from __future__ import annotations

import torch

from subquad.kernels import FLOAT, I64, INT, PTR, Kernel

KERNEL = Kernel("delta_step", [I64, I64, I64, I64, I64, I64, INT, PTR, PTR, PTR, I64, I64, I64, PTR, PTR, PTR, I64,
                               INT, PTR, I64, PTR, PTR, PTR, I64, PTR, INT, PTR, FLOAT, FLOAT, PTR, FLOAT, PTR, PTR,
                               PTR, PTR])


def _rows(t, B):
    t = t.reshape(B, -1)
    return t if t.stride(1) == 1 else t.contiguous()


def _run(q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w, neg_eigval: bool,
         qk_eps: float, scale: float, norm_eps: float, gate_sigmoid: bool):
    Bz, H, K, V = S.shape
    Hk = q.shape[-1] // K
    W = conv_w.shape[-1]
    q, k, v, b = (_rows(t, Bz) for t in (q, k, v, b))
    a = None if a is None else _rows(a, Bz)
    gate = None if gate is None else _rows(gate, Bz)
    C = 2 * Hk * K + H * V
    conv_w = conv_w.reshape(C, W).contiguous()
    conv_state, S = conv_state.contiguous(), S.contiguous()
    out, S_out, conv_out = q.new_empty(Bz, H * V), torch.empty_like(S), conv_state.new_empty(Bz, W - 1, C)
    threads = torch.get_num_threads()
    scratch = q.new_empty(Bz * C + threads * (2 * K + V))
    KERNEL(Bz, H, Hk, K, V, W, threads, q, k, v, q.stride(0), k.stride(0), v.stride(0), conv_state, conv_w, b,
           b.stride(0), int(neg_eigval), a, 0 if a is None else a.stride(0), A_log, dt_bias, gate,
           0 if gate is None else gate.stride(0), gate_bias, int(gate_sigmoid), S, qk_eps, scale, norm_w, norm_eps,
           out, conv_out, S_out, scratch)
    return out, conv_out, S_out


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("delta_step(Tensor q, Tensor k, Tensor v, Tensor conv_state, Tensor conv_w, Tensor b, Tensor? a, "
            "Tensor? A_log, Tensor? dt_bias, Tensor? gate, Tensor? gate_bias, Tensor S, Tensor norm_w, "
            "bool neg_eigval, float qk_eps, float scale, float norm_eps, bool gate_sigmoid) "
            "-> (Tensor, Tensor, Tensor)")
_LIB.impl("delta_step", _run, "CPU")


@torch.library.register_fake("subquad::delta_step")
def _(q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w, neg_eigval, qk_eps, scale,
      norm_eps, gate_sigmoid):
    Bz, H, K, V = S.shape
    return q.new_empty(Bz, H * V), conv_state.new_empty(conv_state.shape), S.new_empty(S.shape)


def delta_step(q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w, neg_eigval: bool,
               qk_eps: float | None, scale: float, norm_eps: float, gate_sigmoid: bool = False):
    """The module doc's step: q, k (B, 1, Hk K), v (B, 1, H V), b / a (B, 1, H) (a None: DeltaNet, ungated), gate
    (B, 1, H V) or None, conv_w (C, 1, W) or (C, W); qk_eps None for F.normalize's l2."""
    args = (q, k, v, conv_state, conv_w, b, a, A_log, dt_bias, gate, gate_bias, S, norm_w, bool(neg_eigval),
            0.0 if qk_eps is None else float(qk_eps), float(scale), float(norm_eps), bool(gate_sigmoid))
    if torch.compiler.is_compiling():
        return torch.ops.subquad.delta_step(*args)
    return _run(*args)
