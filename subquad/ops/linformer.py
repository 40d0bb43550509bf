"""Linformer attention (Wang et al. 2020, arXiv:2006.04768): keys and values projected along time.

    K' = E K,  V' = F V                 E, F (k, T): T keys become k rows
    o  = softmax(scale * Q K'^T) V'     (B, T, H, V): O(T k) instead of O(T^2)

An encoder mechanism: every projected row mixes the whole sequence, so a causal
mask, a recurrent state or decoding token by token have no meaning for it, and
asking for them raises ValueError. E and F are built for a maximum length; a
longer input is refused (a shorter one uses the first T columns).

Shapes: q, k (B, T, H, K); v (B, T, H, V); E, F (k, T_max) shared by all heads,
or (H, k, T_max) per head.
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_qkv, default_scale


def _project(P, x, name):
    """P (k, Tmax) or (H, k, Tmax); x (B, T, H, D) -> (B, k, H, D)."""
    T, H = x.shape[1], x.shape[2]
    if P.dim() not in (2, 3) or (P.dim() == 3 and P.shape[0] != H):
        raise ValueError(f"{name} must be (k, T_max) or (H={H}, k, T_max), got {tuple(P.shape)}")
    if P.shape[-1] < T:
        raise ValueError(f"input length T={T} exceeds the length {P.shape[-1]} that {name} was built for")
    P = P[..., :T].to(x.dtype)
    if P.dim() == 2:
        return torch.einsum("kt,bthd->bkhd", P, x)
    return torch.einsum("hkt,bthd->bkhd", P, x)


def linformer_attention(q, k, v, E, F, *, causal=False, mode="parallel", scale=None, initial_state=None,
                        output_final_state=False, chunk_size=None):
    """Returns (o (B, T, H, V), None): Linformer has no recurrent state."""
    if causal:
        raise ValueError("Linformer has no causal form: each projected key mixes every position, future included")
    if mode != "parallel":
        raise ValueError(f"Linformer has only the parallel form (mode='parallel'), got mode={mode!r}: "
                         "a recurrent or chunked form would need a causal mechanism")
    if initial_state is not None or output_final_state:
        raise ValueError("Linformer carries no state: initial_state / output_final_state have no meaning for it")
    check_qkv(q, k, v)
    scale = default_scale(scale, q.shape[-1])
    kp, vp = _project(E, k, "E"), _project(F, v, "F")                     # (B, k, H, *)
    s = torch.einsum("bthd,bkhd->bhtk", q, kp) * scale
    o = torch.einsum("bhtk,bkhd->bthd", torch.softmax(s, -1), vp)
    return o, None
