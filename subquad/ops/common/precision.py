"""Precision, value checks and compilation at the op boundary: one place for the rules every op follows.

Autocast. Under ``torch.autocast`` the projections around an op hand it 16-bit activations while
gates computed from float32 parameters stay float32. Every public op therefore

  1. casts its activations (q, k, v; Mamba's x, B, C, z) to autocast's dtype, as autocast itself
     does for a matmul's operands: the op returns that dtype, like the matmuls around it;
  2. keeps gates (g, beta, dt, A) and states in float32 (float64 stays float64);
  3. runs with autocast switched off inside, so its own matmuls follow the dtypes it chose:
     the recurrent state, running sums and log-sum-exps are float32 (``state_dtype``) and the
     chunk forms compute in float32 on 16-bit inputs. Custom autograd Functions switch autocast
     off in their backward too (``autocast_off``), so a backward called inside an autocast
     region sees the dtypes the forward saved.

Value checks (gates' signs, beta's range, token ids) read tensor values, which forces a host
sync on an accelerator and cannot run inside a compiled graph. They run by default for CPU
tensors only, never while ``torch.compile`` traces, and ``set_checks(True | False | None)``
turns them on everywhere, off everywhere, or back to that default. Shape, dtype and device
checks always run. Route choices that would read a value (the no-gradient fast paths' choice
between factorised and exact scores) are not taken inside a compiled graph: it runs the
differentiable chunk form, whose route does not depend on values - except the decayed family's
chunk engine (``ops/decay/chunk.py``), which the graph calls as it is, eagerly, as it would a
custom kernel.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_CHECKS: bool | None = None   # None: on for CPU tensors, off elsewhere


def set_checks(enabled: bool | None) -> None:
    """Value checks on (True), off (False), or the default (None: on for CPU tensors only)."""
    global _CHECKS
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    _CHECKS = enabled


def outside_graphs(fn):
    """``torch.compiler.disable(fn)`` - torch.compile runs ``fn`` as it is, outside its graphs - without importing
    torch._dynamo when the module defining ``fn`` is imported (~1.3 s of a process's start, which `subquad --help`,
    a server or a process that never compiles need not pay): the disabled wrapper is made at the first call
    (one graph break more where that call is traced, then the same skip as the decorator's)."""
    made = []

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)

    return run


def compiling() -> bool:
    """True while torch.compile (dynamo) traces the calling code."""
    return torch.compiler.is_compiling()


def checks_on(x: torch.Tensor) -> bool:
    """Whether value checks run for a call on ``x``: never while compiling or on the meta device."""
    if compiling() or x.device.type == "meta":
        return False
    return x.device.type == "cpu" if _CHECKS is None else _CHECKS


def amp_dtype(x) -> torch.dtype | None:
    """Autocast's dtype for x's device when autocast is on there, else None."""
    if not isinstance(x, torch.Tensor) or x.device.type == "meta":
        return None
    dev = x.device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        return torch.get_autocast_dtype(dev)
    except RuntimeError:                       # a device type autocast does not know
        return None


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(dtype)
    return x


def amp_op(positions=(0, 1, 2), keywords=()):
    """Decorate a public op: under autocast, the activations at ``positions`` / ``keywords`` are cast to
    autocast's dtype and the op runs with autocast off (see the module docstring). float64 stays."""
    def deco(fn):
        @functools.wraps(fn)
        def run(*args, **kw):
            dtype = amp_dtype(args[0]) if args else None
            if dtype is None:
                return fn(*args, **kw)
            args = tuple(_cast(a, dtype) if i in positions else a for i, a in enumerate(args))
            kw = {n: (_cast(a, dtype) if n in keywords else a) for n, a in kw.items()}
            with torch.autocast(args[0].device.type, enabled=False):
                return fn(*args, **kw)
        return run
    return deco


def no_autocast(x):
    """A context with autocast off on x's device when it is on there (a null context otherwise), for code
    that calls an op's internals directly and casts its inputs itself."""
    return contextlib.nullcontext() if amp_dtype(x) is None else torch.autocast(x.device.type, enabled=False)


def autocast_off(method):
    """For a custom autograd Function's forward / backward: run with autocast off on the device of its
    first tensor argument (what ``torch.amp.custom_fwd`` / ``custom_bwd`` do for one fixed device type)."""
    @functools.wraps(method)
    def run(ctx, *args):
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if amp_dtype(x) is None:
            return method(ctx, *args)
        with torch.autocast(x.device.type, enabled=False):
            return method(ctx, *args)
    return run


NEG_LOG_DECAY = -1000.0   # exp of it is exactly 0 in float32 and float64, as exp(-inf) is


def finite_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g with -inf (a decay of exactly zero) replaced by -1000, whose exp is also exactly 0: the
    cumulative-sum forms would otherwise take -inf - (-inf) = NaN. Nothing else changes."""
    return g.clamp(min=NEG_LOG_DECAY)


def causal_guard(result, state, recompute, tokens: int):
    """Non-finite input must stay causal. The parallel and chunk forms multiply masked (zero) weights
    with every value of a block, so a NaN / inf at token t reaches earlier tokens' outputs (0 * NaN).
    Any non-finite key, value or gate reaches the final state too (decays multiply it, nothing
    resets it), so when value checks are on a non-finite ``state`` (a small tensor, or the output
    where there is no state) sends the call to ``recompute()``: the token loop, causal by
    construction. A call of one token (a decoding step) has nothing before it and is never checked.
    Returns ``result`` otherwise. The check is one pass: a finite sum has no NaN or inf among its terms (a NaN
    makes the sum NaN, an inf makes it inf or NaN); only a sum that overflows is looked at element by element -
    ``isfinite(state).all()`` is four passes and a bool copy, ~1 ms for a packed prompt's Mamba-2 states."""
    if tokens < 2 or state is None or not checks_on(state):
        return result
    if bool(torch.isfinite(state.sum())) or bool(torch.isfinite(state).all()):
        return result
    return recompute()
