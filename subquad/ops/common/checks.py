"""Input validation shared by the ops. Every failure is a ValueError naming the argument.

Checks read Python scalars and tensor metadata only (shape, dtype, device), never tensor values, so
they cost nothing on an accelerator and run unchanged under ``torch.compile``; checks of values
(gate signs, token ids) are ``precision.checks_on``'s business.

The rules every op follows:

- flags (``output_final_state``, ``normalize``, ``causal``, ``return_lse``, ...) are real bools:
  ``"no"`` or ``0`` is refused, not read as truthy or falsy;
- ``scale`` is None (``K ** -0.5``) or a finite real number (0 is allowed: uniform attention);
- ``chunk_size`` is a positive int in every op and every form, the forms that do not chunk
  included (None is refused everywhere); a size past the call's length T means one chunk of T;
- an ``initial_state`` tensor has exactly the shape of the state the op returns, is on q's (x's)
  device, and has the state's dtype, ``state_dtype(q.dtype)``: float32 for 16- and 32-bit inputs,
  float64 for float64. Another dtype is refused, not cast: a float64 state would be rounded to
  float32 without a word, and a 16-bit one has lost digits the op cannot give back (make states
  with ``layer.empty_state(B, dtype=...)`` or take them from the op). Softmax attention's state is
  a KV cache, whose keys and values have q's dtype and device;
- a batch of 0 sequences is valid in every form: empty outputs and an empty final state.
"""

from __future__ import annotations

import math

import torch

MODES = ("parallel", "recurrent", "chunk")


def describe(x) -> str:
    """How an argument reads in an error: its shape and dtype for a tensor, its repr otherwise."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype}, {x.device})"
    r = repr(x)
    return r if len(r) <= 60 else f"a {type(x).__name__}"


def check_mode(mode, modes=MODES) -> None:
    if not isinstance(mode, str) or mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {describe(mode)}")


def check_bool(name: str, value) -> None:
    """A flag must be True or False: a string such as 'no' would otherwise count as True."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {describe(value)}")


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {describe(chunk_size)}")


def check_real(name: str, value, *, minimum: float | None = None) -> float:
    """A finite Python number (not a bool, not a tensor), at least ``minimum``; returned as a float. Under
    torch.compile it is returned unchecked: dynamo traces a layer's float attributes (scale, eps) as symbolic
    numbers, and ``math.isfinite`` of one is a graph break - in a compiled decoding step, a graph per frame
    of every layer instead of one graph (a layer's values were checked when it was built)."""
    if torch.compiler.is_compiling():
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be finite: a real number, not a bool or a tensor; got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)


def _check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {describe(x)}")
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
        raise ValueError(f"{name} must be a torch.Tensor of shape {tuple(shape)}, got {describe(x)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (for {ref_name} of shape {tuple(ref.shape)}), got "
                         f"{tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")


def check_gate_dtype(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str = "q") -> None:
    """A gate (decay, step size, write strength) may be float32 or float64 beside 16-bit activations (gates
    computed from float32 parameters stay float32 under autocast), or have the activations' dtype."""
    if x.dtype != ref.dtype and x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be float32, float64 or {ref_name}'s dtype {ref.dtype}, got {x.dtype}")


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent state precision: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_state(name: str, x, shape: tuple, ref: torch.Tensor, ref_name: str = "q") -> None:
    """An initial state: ``check_like`` and the state's dtype, ``state_dtype(ref.dtype)`` (module docstring)."""
    check_like(name, x, shape, ref, ref_name)
    want = state_dtype(ref.dtype)
    if x.dtype != want:
        raise ValueError(f"{name} must have the state's dtype {want} for {ref_name} of dtype {ref.dtype} "
                         f"(float32 for 16- and 32-bit inputs, float64 for float64), got {x.dtype}")


def default_scale(scale, k_dim: int) -> float:
    """None means ``k_dim ** -0.5``; otherwise a finite number (0 included)."""
    return k_dim ** -0.5 if scale is None else check_real("scale", scale)
