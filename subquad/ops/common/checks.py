"""Input validation shared by the ops. Every failure is a ValueError naming the argument."""

from __future__ import annotations

import torch

MODES = ("parallel", "recurrent", "chunk")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_qkv(q, k, v, *, same_length: bool = True) -> None:
    """q, k: (B, T, H, K); v: (B, T, H, V); one dtype and device for all three."""
    _check_tensor("q", q, 4, "(B, T, H, K)")
    _check_tensor("k", k, 4, "(B, T, H, K)")
    _check_tensor("v", v, 4, "(B, T, H, V)")
    if k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] or (same_length and k.shape[1] != q.shape[1]):
        raise ValueError(f"k must match q's shape (B, T, H, K): q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) with B, T, H of k: k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")


def check_like(name: str, x, shape: tuple, ref: torch.Tensor, ref_name: str = "q") -> None:
    """A state or gate tensor: exact shape, floating point, on ref's device."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent state precision: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(scale, k_dim: int) -> float:
    if scale is None:
        return k_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {scale!r}")
    return float(scale)
