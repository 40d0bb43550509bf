"""The sequence-mixing entry point: the one place where a layer reaches across tokens.

A mixer computes its per-token projections, gates and norms itself and hands everything that
crosses tokens to the active backend:

    seq = backend()
    pos      = seq.positions(T, start, device)                  rotary / learned positions
    end      = seq.length(T, start)                              where the whole sequence ends
    y, tail  = seq.causal_conv(conv, x, reach, tail)             conv(x, tail) -> (y, new tail)
    o, cache = seq.attention(q, k, v, window=W, initial_state=cache, mode=..., chunk_size=...)
    o, S     = seq.recurrence(op, *inputs, initial_state=S, mode=..., chunk_size=..., **options)

The default backend, ``SingleDevice``, calls ``subquad.ops`` on whole sequences. A wrapper applied
from outside redirects these calls with ``use(backend)``: ``subquad.distributed.context_parallel``
installs a backend that runs them on one rank's shard of each sequence (ring attention, state
passing, convolution halos, global positions). Layers and models stay single-device code that read
as their papers' equations, and a new mixer built from these calls is context-parallel as it is.

A backend whose ``whole_sequence`` is False sees only part of each sequence: it takes no decoding
state in and gives none back (``subquad.layers.base.Mixer.forward`` enforces both).
"""

from __future__ import annotations

import contextlib

import torch

_ACTIVE: list = []


class SingleDevice:
    """Whole sequences on one device: the ops as they are."""

    whole_sequence = True

    def positions(self, T: int, start=0, device=None):
        """Positions of this call's T tokens after ``start`` earlier ones: ``start`` itself when it is an
        int (rotary takes the offset), else ``start + arange(T)`` (a 0-d tensor start: no host sync)."""
        if isinstance(start, torch.Tensor):
            return start.to(device) + torch.arange(T, device=device)
        return start

    def length(self, T: int, start: int = 0) -> int:
        """Tokens of the whole sequence up to the end of this call (learned positions check it)."""
        return start + T

    def causal_conv(self, conv, x, reach: int, tail=None):
        """``conv(x, tail) -> (y, new tail)``: a causal convolution that reads ``reach`` tokens back."""
        return conv(x, tail)

    def attention(self, q, k, v, **options):
        """Causal softmax attention (``subquad.ops.softmax_attention``): (o, final state)."""
        from subquad.ops import softmax_attention

        return softmax_attention(q, k, v, **options)

    def recurrence(self, op, *inputs, **options):
        """``op(*inputs, **options, output_final_state=True)``: (o, final state)."""
        return op(*inputs, output_final_state=True, **options)


SINGLE_DEVICE = SingleDevice()


def backend():
    """The backend the layers call now: the innermost ``use``, else ``SINGLE_DEVICE``."""
    return _ACTIVE[-1] if _ACTIVE else SINGLE_DEVICE


@contextlib.contextmanager
def use(b):
    """Route every layer's sequence mixing through ``b`` inside the ``with`` block."""
    _ACTIVE.append(b)
    try:
        yield b
    finally:
        _ACTIVE.pop()


__all__ = ["SingleDevice", "SINGLE_DEVICE", "backend", "use"]
