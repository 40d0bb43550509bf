"""The sequence-mixing entry point: the one place where a layer reaches across tokens.

A mixer computes its per-token projections, gates and norms itself and hands everything that
crosses tokens to the active backend:

    seq = backend()
    pos      = seq.positions(T, start, device)                  rotary / learned positions
    end      = seq.length(T, start)                              where the longest sequence ends
    n        = seq.tokens(B, T, device)                          tokens this call adds to each sequence
    y, tail  = seq.causal_conv(conv, x, reach, tail)             conv(x, tail) -> (y, new tail)
    o, cache = seq.attention(q, k, v, window=W, initial_state=cache, mode=..., chunk_size=...)
    o, S     = seq.recurrence(op, *inputs, initial_state=S, mode=..., chunk_size=..., **options)

The default backend, ``SingleDevice``, calls ``subquad.ops`` on whole sequences. A wrapper applied
from outside redirects these calls with ``use(backend)``: ``subquad.distributed.context_parallel``
installs a backend that runs them on one rank's shard of each sequence (ring attention, state
passing, convolution halos, global positions). Layers and models stay single-device code that read
as their papers' equations, and a new mixer built from these calls is context-parallel as it is.

``Packed`` (``use(Packed(cu_seqlens))``, what ``Mixer.forward(x, state, cu_seqlens)`` installs) runs
a packed row of N sequences with boundaries: positions restart at each sequence, convolutions and
recurrences stop at each boundary (the ops' ``cu_seqlens``), and states have one row per sequence.

A backend whose ``whole_sequence`` is False sees only part of each sequence: it takes no decoding
state in and gives none back (``subquad.layers.base.Mixer.forward`` enforces both).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch

# The ``use`` stack, innermost last. A ContextVar, not a module-global list: each thread and each asyncio task
# has its own, so two threads generating ragged batches (each layer pushes ``Packed``) never run under each
# other's backend. A tuple: ``use`` sets a new one and restores the old, nothing shared is mutated.
_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("subquad_sequence_backend", default=())
# The same stack per thread, for code that torch.compile traces: dynamo cannot read a ContextVar (a graph break
# in every layer's forward, so a compiled model became a graph per layer and frame) but reads a threading.local's
# attribute and guards on it (a graph built under one backend is not reused under another). ``use`` keeps it
# equal to the ContextVar of the thread's latest ``use``; it differs only for asyncio tasks whose ``use``
# blocks interleave across an await, and compiled code between them sees the latest.
_THREAD = threading.local()


class SingleDevice:
    """Whole sequences on one device: the ops as they are."""

    whole_sequence = True

    cu_seqlens = None

    def positions(self, T: int, start=0, device=None):
        """Positions of this call's T tokens after ``start`` earlier ones: ``start`` itself when it is an
        int (rotary takes the offset); for a tensor start (no host sync) ``start + arange(T)``, (T,) for a
        0-d start and (B, T) for one start per row."""
        if isinstance(start, torch.Tensor):
            return start.to(device).unsqueeze(-1) + torch.arange(T, device=device)
        return start

    def length(self, T: int, start=0) -> int:
        """Tokens of the longest sequence up to the end of this call (learned positions check it)."""
        return int(start.max()) + T if isinstance(start, torch.Tensor) else start + T

    def tokens(self, B: int, T: int, device=None) -> torch.Tensor:
        """(B,) tokens this call adds to each row's sequence."""
        return torch.full((B,), T, dtype=torch.long, device=device)

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


def each_sequence(conv, x, tail, lengths: list):
    """``conv(x_i, tail_i) -> (y_i, new tail_i)`` over each sequence of a packed row x (1, T, ...) alone, from row
    i of ``tail`` (or None), put back together: (y (1, T, ...), new tails (N, ...))."""
    tails = [None] * len(lengths) if tail is None else tail.split(1, 0)
    outs = [conv(xi, ti) for xi, ti in zip(x.split(lengths, 1), tails)]
    return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 0)


class Packed(SingleDevice):
    """N sequences packed in one row (B = 1) with boundaries ``cu_seqlens`` (N + 1,): see the module docstring.
    States have one row per sequence; a ``start`` given per sequence is an (N,) tensor."""

    def __init__(self, cu_seqlens):
        from subquad.ops.common.varlen import seq_lengths

        self.cu_seqlens = cu_seqlens
        self.lengths = seq_lengths(cu_seqlens, None, 1)       # checked first: a 2-D tensor is named, not indexed

    def _check(self, T):
        if T != sum(self.lengths):
            raise ValueError(f"cu_seqlens covers {sum(self.lengths)} tokens, the input holds {T}")

    def _seq_ids(self, device):
        return torch.repeat_interleave(torch.arange(len(self.lengths), device=device),
                                       torch.tensor(self.lengths, device=device))

    def positions(self, T: int, start=0, device=None):
        """(T,) positions restarting at each sequence's start (plus that sequence's ``start``)."""
        self._check(T)
        ids = self._seq_ids(device)
        first = torch.tensor([0] + self.lengths[:-1], device=device).cumsum(0)
        pos = torch.arange(T, device=device) - first[ids]
        if isinstance(start, torch.Tensor):
            return pos + start.to(device).reshape(-1).expand(len(self.lengths))[ids]
        return pos + start

    def length(self, T: int, start=0) -> int:
        self._check(T)
        ends = torch.tensor(self.lengths) + (start.cpu() if isinstance(start, torch.Tensor) else start)
        return int(ends.max())

    def tokens(self, B: int, T: int, device=None) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.long, device=device)

    def causal_conv(self, conv, x, reach: int, tail=None):
        """The convolution over each sequence alone, from its own tail (row i of ``tail``): in one call where the
        convolution takes ``cu_seqlens`` itself (``layers.conv.ShortConv``)."""
        self._check(x.shape[1])
        if getattr(conv, "takes_cu_seqlens", False):
            return conv(x, tail, cu_seqlens=self.cu_seqlens)
        return each_sequence(conv, x, tail, self.lengths)

    def attention(self, q, k, v, **options):
        from subquad.ops import softmax_attention

        return softmax_attention(q, k, v, cu_seqlens=self.cu_seqlens, **options)

    def recurrence(self, op, *inputs, **options):
        return op(*inputs, output_final_state=True, cu_seqlens=self.cu_seqlens, **options)


def backend():
    """The backend the layers call now: this thread's (or task's) innermost ``use``, else ``SINGLE_DEVICE``."""
    active = getattr(_THREAD, "stack", ()) if torch.compiler.is_compiling() else _ACTIVE.get()
    return active[-1] if active else SINGLE_DEVICE


@contextlib.contextmanager
def use(b):
    """Route every layer's sequence mixing through ``b`` inside the ``with`` block, in this thread (or asyncio
    task) only: a thread started inside does not inherit it."""
    token = _ACTIVE.set((*_ACTIVE.get(), b))
    _THREAD.stack = _ACTIVE.get()
    try:
        yield b
    finally:
        _ACTIVE.reset(token)
        _THREAD.stack = _ACTIVE.get()


__all__ = ["SingleDevice", "SINGLE_DEVICE", "Packed", "backend", "use"]
