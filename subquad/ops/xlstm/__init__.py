"""The mLSTM (xLSTM's matrix memory; Beck et al. 2024, arXiv:2405.04517; xLSTM-7B, arXiv:2503.13427), in three forms.

    m_t = max(g_t + m_{t-1}, i_t)                                     the max stabiliser (log space)
    C_t = exp(g_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(g_t + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = (s q_t)^T C_t / (max(|(s q_t)^T n_t|, exp(-m_t)) + eps)

``g = logsigmoid(f~) <= 0`` is the forget gate in log space and ``i`` the input gate's pre-activation (any real:
the gate exp(i) is exponential, which the stabiliser m keeps from overflowing). C and n are the true memory and
normaliser times exp(-m_t), so the denominator's ``exp(-m_t)`` is the paper's lower bound 1 on |n^T q|. Shapes: q, k
(B, T, H, K); v, o (B, T, H, V); g, i (B, T, H); state (C (B, H, K, V), n (B, H, K), m (B, H)), float32 (float64 for
float64 inputs). The empty state is all zeros, m_0 = 0 included: the convention of NX-AI's kernels and
transformers' xLSTM (m_0 reaches the outputs through eps alone, README.md). ``scale=None`` is
K ** -0.5 on q; ``eps`` is added after the max, as xLSTM-7B does (1e-6).

The family's folder is ``xlstm/`` (the op is ``mlstm``: no function shadows its package). Forms: ``recurrent.py``
the token loop (the spec, decoding); ``parallel.py`` the stabilised T x T form;
``chunk.py`` chunkwise with the stabiliser carried across chunks. All compute the same m_t, so they agree to
rounding, and all treat m as a constant to autograd (the derivative dropped is of order eps; README.md). The
state is not affine in the initial one (m enters through a max): no ``Transition`` is declared,
and context parallelism refuses the op by name.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from subquad.ops import mlstm
    >>> q, k, v = torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 8)
    >>> g, i = F.logsigmoid(torch.randn(1, 100, 2) + 3), torch.randn(1, 100, 2)
    >>> o, (C, n, m) = mlstm(q, k, v, g, i, mode="chunk", output_final_state=True)
    >>> o.shape, C.shape, n.shape, m.shape
    (torch.Size([1, 100, 2, 8]), torch.Size([1, 2, 16, 8]), torch.Size([1, 2, 16]), torch.Size([1, 2]))
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import (
    check_bool,
    check_chunk_size,
    check_gate_dtype,
    check_like,
    check_mode,
    check_qkv,
    check_real,
    check_state,
    default_scale,
    state_dtype,
)
from subquad.ops.common.forms import three_forms
from subquad.ops.common.precision import (
    amp_op,
    causal_guard,
    checks_on,
    finite_log_decay,
)
from subquad.ops.common.varlen import varlen
from subquad.ops.xlstm.chunk import mlstm_chunk
from subquad.ops.xlstm.parallel import mlstm_parallel
from subquad.ops.xlstm.recurrent import mlstm_recurrent, mlstm_step

_FORMS = {"parallel": mlstm_parallel, "recurrent": mlstm_recurrent, "chunk": mlstm_chunk}


def empty_mlstm_state(B, H, K, V, device=None, dtype=torch.float32):
    """(C, n, m) of zeros in the state's dtype for inputs of ``dtype``."""
    sd = state_dtype(dtype)
    return (torch.zeros(B, H, K, V, device=device, dtype=sd), torch.zeros(B, H, K, device=device, dtype=sd),
            torch.zeros(B, H, device=device, dtype=sd))


@amp_op()
@varlen("q", "k", "v", "g", "i")
def mlstm(q, k, v, g, i, *, eps=1e-6, mode="chunk", chunk_size=64, scale=None, initial_state=None,
          output_final_state=False):
    """mLSTM: g (B, T, H) the log forget gate (<= 0), i (B, T, H) the log input gate; see the module docstring.
    ``initial_state``: (C, n, m) or None (zeros). Returns (o (B, T, H, V), (C, n, m) or None)."""
    check_qkv(q, k, v)
    check_mode(mode)
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    for name, t in (("g", g), ("i", i)):
        check_like(name, t, (B, T, H), q)
        check_gate_dtype(name, t, q)
    if checks_on(g) and (g > 0).any():
        raise ValueError(f"g is a log forget gate and must be <= 0 everywhere; got max {g.max().item():.3g}")
    eps = check_real("eps", eps, minimum=0.0)
    scale = default_scale(scale, K)
    V = v.shape[-1]
    sd = state_dtype(q.dtype)
    if initial_state is None:
        initial_state = empty_mlstm_state(B, H, K, V, q.device, q.dtype)
    else:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 3:
            raise ValueError(f"initial_state must be the triple (C, n, m), got {type(initial_state).__name__}")
        names = ("initial_state[0] (C)", "initial_state[1] (n)", "initial_state[2] (m)")
        for name, t, shape in zip(names, initial_state, ((B, H, K, V), (B, H, K), (B, H))):
            check_state(name, t, shape, q)
        initial_state = tuple(initial_state)
    out_dtype = q.dtype
    q, k, v = q.to(sd), k.to(sd), v.to(sd)
    g, i = finite_log_decay(g.to(sd)), i.to(sd)      # a forget gate of exactly 0: the same in every form

    def run(form):
        return _FORMS[form](q, k, v, g, i, scale=scale, eps=eps, chunk_size=chunk_size, initial_state=initial_state)

    o, S = run(mode)
    if mode != "recurrent":                          # non-finite input stays causal
        o, S = causal_guard((o, S), S[0], lambda: run("recurrent"), T)
    return o.to(out_dtype), (S if output_final_state else None)


parallel_mlstm, recurrent_mlstm, chunk_mlstm = three_forms(mlstm)

__all__ = ["chunk_mlstm", "empty_mlstm_state", "mlstm", "mlstm_step", "parallel_mlstm", "recurrent_mlstm"]
