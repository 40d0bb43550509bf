"""A pre-norm softmax attention block's mixer half at a decoding token in two C calls (``kernels/attention_step.c``).

    x = rmsnorm(h);  q, k, v = x W_q^T, x W_k^T, x W_v^T, q and k normed per head, rotated   attn_in_rows
    the cache's append (``ops.softmax.cache.KVCache``, Python's, as the layer appends)
    h' = h + (softmax(scale q K^T) V * sigmoid(gate)) W_o^T over each row's cached tokens    attn_out_rows

A hybrid's attention layers (Bamba's, Nemotron-H's, Jamba's, LFM2's, Qwen3.5's) decode through a dozen small
ops, two module calls and the rotary's angles each token: ~0.8 ms a layer at mamba2-130m's width on the Sapphire
Rapids host, a tenth of a hybrid's 8-bit token (benchmarks/RESULTS.md); here the same math costs two calls.
``fused_attention(attn, h, norm, state)`` -> (h + attn(norm(h)), new state) for h (B, 1, d), or None where it does
not apply: while compiling, a ``SoftmaxAttention`` with a head gate, q / k norms over all heads (per head they
apply, as the output gate does), a window or an output width other than d_model (or a subclass), a norm other than
a plain RMSNorm, more than ``layers.linear.C_ROWS`` rows, a projection the kernels do not read
(``layers.mamba.kernel_weight``), a sequence backend other than ``SingleDevice``, a cache that is not a float32
CPU ``KVCache`` without a window, or what ``kernels.usable`` refuses. The calls are kept per layer and rows (a
weak mapping) with a ``kernels.Held`` of what they read. The state passed in is left as it was: the new keys and
values go to a fork of the cache, as the layer's own step appends them. The layer's ``attend`` (SDPA) is the reference.
"""

from __future__ import annotations

import array
import ctypes
import weakref

import torch

from subquad import kernels
from subquad.kernels import FLOAT, I64, INT, PTR, Call, Kernel
from subquad.kernels.qgemv import proj_args
from subquad.layers import sequence
from subquad.layers.attention import SoftmaxAttention
from subquad.layers.linear import C_ROWS
from subquad.layers.mamba import kernel_weight
from subquad.layers.norm import RMSNorm
from subquad.layers.sequence import SingleDevice
from subquad.ops import KVCache

_PROJ = [PTR, PTR, PTR, INT, I64]          # weight, scale, bias, kind, groups
IN = Kernel("attn_in_rows", [I64] * 6 + [ctypes.c_double, INT, INT, PTR, PTR, FLOAT] + _PROJ * 3
            + [PTR, FLOAT, PTR, FLOAT] + [PTR] * 6, "attention_step")
OUT = Kernel("attn_out_rows", [I64] * 6 + [INT, PTR, PTR, I64, PTR, I64, PTR, FLOAT, PTR, PTR] + _PROJ + [PTR, PTR],
             "attention_step")
IN_FLOATS, IN_DOUBLE, OUT_FLOATS = (11, 28, 30), 6, (13,)           # the float (eps, scale) and double (base) args
_PLANS = kernels.KeptCalls()                                        # attention -> {rows: Step}


def _plain(norm) -> bool:
    return type(norm) is RMSNorm and norm.weight is not None and norm.bias is None


def fits(attn, norm) -> bool:
    """Whether ``attn`` after ``norm`` is what the kernels compute (the rows, weights and state aside)."""
    return type(attn) is SoftmaxAttention and attn.g_proj is None and attn.window is None \
        and (attn.qk_norm is None or (attn.qk_norm == "head" and _plain(attn.q_norm) and _plain(attn.k_norm))) \
        and attn.o_proj.out_features == attn.d_model and _plain(norm)


class Step:
    """Both calls for ``B`` rows of ``attn`` after ``norm`` with the weights fixed (``kernels.Call``):
    ``step(h (B, 1, d), cache, seq)`` -> (h', the cache's fork with this token appended)."""

    def __init__(self, attn, norm, B: int, projs: list):
        H, Hk, K, d = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.d_model
        self.B, self.d, self.shape = B, d, (H, Hk, K)
        self.attn = weakref.ref(attn)
        (wq, sq, kq, gq), (wk, sk, kk, gk), (wv, sv, kv, gv), (wo, so, ko, go) = map(proj_args, projs)
        lins = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        bq, bk, bv, bo = (lin.bias for lin in lins)
        qn, kn = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
        norms = [None if n is None else n.weight for n in (qn, kn)]
        self.tensors = [norm.weight, wq, sq, bq, wk, sk, bk, wv, sv, bv, wo, so, bo, *norms]
        self.floats = [norm.weight, *norms] + [t for p, lin in zip(projs, lins) for t in (p, lin.bias)
                                               if not isinstance(t, tuple)]
        R = attn.rotary_dim if attn.rotary else 0
        self.gated = attn.output_gate
        self.scale = attn.scale if attn.scale is not None else K ** -0.5
        eps = [0.0 if n is None else float(n.eps) for n in (qn, kn)]
        self.call_in = Call(IN, [B, d, H, Hk, K, R, attn.rotary_base, int(self.gated), None, None, norm.weight,
                                 float(norm.eps), wq, sq, bq, kq, gq, wk, sk, bk, kk, gk, wv, sv, bv, kv, gv,
                                 norms[0], eps[0], norms[1], eps[1], None, None, None, None, None, None],
                            (8, 9, 31, 32, 33, 34, 35, 36))
        self.call_out = Call(OUT, [B, d, H, Hk, K, None, None, None, None, None, None, None, None, self.scale, None,
                                   None, wo, so, bo, ko, go, None, None], (5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 21, 22))

    def __call__(self, h, cache: KVCache, seq):
        B, d, (H, Hk, K) = self.B, self.d, self.shape
        h2 = h.reshape(B, d).contiguous()
        pos = cache.next_position             # every row's position: a C array, not a tensor, where it is one int
        if isinstance(pos, torch.Tensor):
            pos = pos_ptr = pos.to(torch.int64).expand(B).contiguous()
        else:
            pos = array.array("q", [pos]) * B   # (held here through the call)
            pos_ptr = pos.buffer_info()[0]
        q, k, v = h2.new_empty(B, H * K), h2.new_empty(B, 1, Hk, K), h2.new_empty(B, 1, Hk, K)
        gate = h2.new_empty(B, H * K) if self.gated else None
        threads = torch.get_num_threads()
        self.call_in(threads, h2, pos_ptr, q, gate, k, v, h2.new_empty(B * (d + 2 * H * K)))
        new = self.attn()._extend(cache, k, v, seq)
        kc, vc = new.k, new.v
        L = kc.shape[1]
        start = None if new.pad is None else (new.pad - new.offset).clamp_min(0).to(torch.int64).contiguous()
        h_out = h2.new_empty(B, d)
        self.call_out(L, threads, q, kc, kc.stride(0), vc, vc.stride(0), start, gate, h2, h_out,
                      h2.new_empty(B * H * (K + L)))
        return h_out.view(B, 1, d), new


def cache_ok(cache) -> bool:
    """A float32 CPU ``KVCache`` without a window whose entries lie as (B, L, Hk, K) rows the kernel strides."""
    if type(cache) is not KVCache or cache.window is not None:
        return False
    k, v = cache._k, cache._v
    return k.dtype == torch.float32 and v.dtype == torch.float32 and k.is_cpu and v.is_cpu \
        and k.stride()[1:] == (k.shape[2] * k.shape[3], k.shape[3], 1) \
        and v.stride()[1:] == (v.shape[2] * v.shape[3], v.shape[3], 1)


def _build(attn, norm, B: int):
    projs = [kernel_weight(lin, B) for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
    return None if any(p is None for p in projs) else Step(attn, norm, B, projs)


def kept_plan(attn, norm, rows: int):
    """(``kernels.Held``, ``Step``) kept for ``attn`` after ``norm`` at ``rows`` rows, or None where none is kept
    (``models.stack`` runs it beside a hybrid's Mamba-2 blocks in one call: ``models.layer_stack``)."""
    return _PLANS.peek(attn, norm, rows)


def fused_attention(attn, h, norm, state):
    """The module doc's call: h (B, 1, d), the layer's state -> (h', new state), or None."""
    if torch.compiler.is_compiling() or state is None or h.dim() != 3 or h.shape[1] != 1:
        return None
    B, seq = h.shape[0], sequence.backend()
    cache = state.get("kv") if type(state) is dict and len(state) == 1 else None
    if B > C_ROWS or type(seq) is not SingleDevice or seq.cu_seqlens is not None or not cache_ok(cache) \
            or cache.k.shape[0] != B or not fits(attn, norm):
        return None
    def make():
        step = _build(attn, norm, B)
        ok = step is not None and kernels.usable(OUT, h, *step.floats) and kernels.usable(IN, h)
        return step if ok else None
    got = _PLANS.get(attn, norm, B, make)
    if got is None or (got[2] and not kernels.usable(OUT, h)):
        return None
    step = got[1]
    h, new = step(h, cache, seq)
    return h, {"kv": new}
