"""Tiny valid calls of every public op, for the bad-input tests: each op's positional inputs at
B, T, H, K, V = 1, 5, 2, 4, 3 (K != V, so a swapped size shows), float32 unless asked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import subquad.ops as ops

B, T, H, K, V = 1, 5, 2, 4, 3
N, P = 3, 4                      # SSD's state size and head dim; the scan's channels are H * P

# the op each public function belongs to: the op itself, its three forms, and the two extra functions
FAMILY = {**{name: name for name in ops.OPS},
          **{f"{form}_{name}": name for name in ops.OPS for form in ("parallel", "recurrent", "chunk")},
          "naive_softmax_attention": "softmax_attention", "linformer_attention": "linformer_attention",
          "merge_attention": "merge_attention"}


def inputs(name: str, b: int = B, t: int = T, dtype=torch.float32, seed: int = 0) -> dict:
    """The positional inputs of ``name`` (a public function of subquad.ops) by parameter name, valid."""
    family = FAMILY[name]
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    def u(*s):
        return torch.rand(*s, generator=g, dtype=dtype)

    q, k, v = r(b, t, H, K), F.normalize(r(b, t, H, K), dim=-1), r(b, t, H, V)
    if family == "linear_attention":
        return {"q": q.abs(), "k": k.abs(), "v": v}
    if family in ("softmax_attention",):
        return {"q": q, "k": k, "v": v}
    if family == "linformer_attention":
        return {"q": q, "k": k, "v": v, "E": r(2, t + 1), "F": r(2, t + 1)}
    if family == "merge_attention":
        return {"o1": r(b, t, H, V), "lse1": r(b, t, H), "o2": r(b, t, H, V), "lse2": r(b, t, H)}
    if family == "retention":
        return {"q": q, "k": k, "v": v, "g": -u(H) - 0.1}
    if family == "simple_gla":
        return {"q": q, "k": k, "v": v, "g": -u(b, t, H)}
    if family == "gla":
        return {"q": q, "k": k, "v": v, "g": -u(b, t, H, K)}
    if family == "delta_rule":
        return {"q": q, "k": k, "v": v, "beta": u(b, t, H)}
    if family == "gated_delta_rule":
        return {"q": q, "k": k, "v": v, "g": -u(b, t, H), "beta": u(b, t, H)}
    if family == "generalized_delta_rule":                  # RWKV-7's a = -kk, b = lr * kk
        return {"q": q, "k": k, "v": v, "w": -u(b, t, H, K), "a": -k, "b": u(b, t, H, 1) * k}
    if family == "ssd":
        return {"x": r(b, t, H, P), "dt": u(b, t, H), "A": -u(H), "B": r(b, t, N), "C": r(b, t, N)}
    if family == "selective_scan":
        return {"x": r(b, t, H * P), "dt": u(b, t, H * P), "A": -u(H * P, N), "B": r(b, t, N), "C": r(b, t, N)}
    if family == "mlstm":                                   # a log forget gate and a log input gate
        return {"q": q, "k": k, "v": v, "g": -u(b, t, H), "i": r(b, t, H)}
    if family == "rg_lru":
        return {"x": r(b, t, H, P), "g": -u(b, t, H, P)}
    raise KeyError(name)


def stateful(name: str) -> bool:
    """Whether ``name`` takes an initial_state and returns a final one."""
    return FAMILY[name] in ops.OPS
