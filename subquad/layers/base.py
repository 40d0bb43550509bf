"""The mixer contract every layer follows.

    y, state = layer(x, state=None)      x, y (B, T, D); state a dict of tensors (or None)
    state    = layer.empty_state(B)      what decoding starts from
    layer.state_bytes(state)             bytes of the tensors the state holds (measured, not computed)

Prefill a prompt with one call, then feed one token at a time with the state the
previous call returned: the outputs equal one forward over the whole sequence.

Mixers with a fixed-size state use that exactness: a sequence longer than ``piece_size``
tokens runs as consecutive pieces with the state carried between them (and autograd
through it). The result is the same; every temporary is a piece long instead of T long,
so inference memory stays bounded at any length, and it is faster: glibc hands large
temporaries fresh pages on every call (see BENCHMARKS.md). At T = 16K, pieces of
1-2K tokens make the fixed-state layers 1.1-1.4x faster forward and 1.07-1.8x faster
forward+backward (benchmarks/bench_pieces.py).
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.ops.common.chunking import in_pieces


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside a (nested) dict / list / tuple / object with ``nbytes``."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    return 0


class Mixer(nn.Module):
    """Base class: a sequence mixer (B, T, D) -> (B, T, D) that carries its own decoding state."""

    piece_size: int | None = None   # fixed-state mixers: tokens per piece of a long forward

    def __init__(self, d_model: int, mode: str = "chunk", chunk_size: int = 64):
        super().__init__()
        from subquad.ops.common.checks import check_chunk_size, check_mode

        if d_model <= 0:
            raise ValueError(f"d_model must be positive, got {d_model}")
        check_mode(mode)
        check_chunk_size(chunk_size)
        self.d_model, self.mode, self.chunk_size = d_model, mode, chunk_size

    def _check_x(self, x):
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.d_model}), got shape {tuple(x.shape)}")

    def _in_pieces(self, x, state):
        """(y, state) of a long forward run piece by piece with the state carried (autograd follows the
        state from piece to piece), or None where that does not apply (x is short, the mixer has no fixed
        state, or a context-parallel run is on)."""
        P = self.piece_size
        if not P or x.shape[1] <= P or self._context(state) is not None:
            return None
        return in_pieces(self, (x,), P, state)

    @staticmethod
    def _context(state):
        """The active context-parallel run (``subquad.distributed.context_parallel``), or None.

        Inside one, x holds this rank's shard of each sequence and the mixer returns no state.
        """
        from subquad.distributed.context import current

        cp = current()
        if cp is not None and state is not None:
            raise ValueError("context parallelism runs whole sequences from an empty state; got a decoding state")
        return cp

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        raise NotImplementedError

    def state_bytes(self, state) -> int:
        return tensor_bytes(state)
