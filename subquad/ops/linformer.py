"""Linformer attention (Wang et al. 2020, arXiv:2006.04768): keys and values projected along time.

    K' = E K,  V' = F V                 E, F (k, T): T keys become k rows
    o  = softmax(scale * Q K'^T) V'     (B, T, H, V): O(T k) instead of O(T^2)

An encoder mechanism: every projected row mixes the whole sequence, so a causal
mask, a recurrent state or decoding token by token have no meaning for it, and
asking for them raises ValueError. E and F are built for a maximum length; a
longer input is refused (a shorter one uses the first T columns).

Shapes: q, k (B, T, H, K); v (B, T, H, V); E, F (k, T_max) shared by all heads,
or (H, k, T_max) per head, floating point (cast to q's dtype), on q's device, with
the same k. ``chunk_size`` C: the queries in blocks of C, so the scores held at once
are (B, H, C, k) instead of (B, H, T, k); None takes every query at once.
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_bool, check_chunk_size, check_qkv, default_scale, describe


def _check_projection(P, name: str, q: torch.Tensor) -> None:
    H = q.shape[2]
    if not isinstance(P, torch.Tensor):
        raise ValueError(f"{name} must be a tensor (k, T_max) or (H={H}, k, T_max), got {describe(P)}")
    if P.dim() not in (2, 3) or (P.dim() == 3 and P.shape[0] != H):
        raise ValueError(f"{name} must be (k, T_max) or (H={H}, k, T_max), got {tuple(P.shape)}")
    if not P.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {P.dtype}")
    if P.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {P.device}")
    if P.shape[-1] < q.shape[1]:
        raise ValueError(f"input length T={q.shape[1]} exceeds the length {P.shape[-1]} that {name} was built for")


def _project(P, x):
    """P (k, Tmax) or (H, k, Tmax); x (B, T, H, D) -> (B, k, H, D)."""
    P = P[..., :x.shape[1]].to(x.dtype)
    if P.dim() == 2:
        return torch.einsum("kt,bthd->bkhd", P, x)
    return torch.einsum("hkt,bthd->bkhd", P, x)


def linformer_attention(q, k, v, E, F, *, causal=False, mode="parallel", scale=None, initial_state=None,
                        output_final_state=False, chunk_size=None):
    """Returns (o (B, T, H, V), None): Linformer has no recurrent state."""
    check_bool("causal", causal)
    check_bool("output_final_state", output_final_state)
    if causal:
        raise ValueError("Linformer has no causal form: each projected key mixes every position, future included")
    if not isinstance(mode, str) or mode != "parallel":
        raise ValueError(f"Linformer has only the parallel form (mode='parallel'), got mode={describe(mode)}: "
                         "a recurrent or chunked form would need a causal mechanism")
    if initial_state is not None or output_final_state:
        raise ValueError("Linformer carries no state: initial_state / output_final_state have no meaning for it")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    check_qkv(q, k, v)
    scale = default_scale(scale, q.shape[-1])
    _check_projection(E, "E", q)
    _check_projection(F, "F", q)
    if E.shape[-2] != F.shape[-2]:
        raise ValueError(f"E and F must project to the same number of rows k: E {tuple(E.shape)}, F {tuple(F.shape)}")
    kp, vp = _project(E, k), _project(F, v)                               # (B, k, H, *)
    T = q.shape[1]
    C = max(1, T if chunk_size is None else min(chunk_size, T))
    outs = []
    for s in range(0, max(T, 1), C):                                              # query blocks: (B, H, C, k) scores
        sc = torch.einsum("bthd,bkhd->bhtk", q[:, s:s + C], kp) * scale
        outs.append(torch.einsum("bhtk,bkhd->bthd", torch.softmax(sc, -1), vp))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), None
