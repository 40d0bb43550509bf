"""Context parallelism for a whole model: one sequence split over the P ranks of a process group.

    with context_parallel(group) as cp:
        logits = model(zigzag_shard(idx, cp.rank, cp.world))     # this rank's 2c of the T = 2Pc tokens

Layout (zigzag, as ring attention's): the sequence is cut into 2P pieces of c tokens and
rank r holds pieces r and 2P-1-r, in that order. The model stays single-device code:
``context_parallel`` installs a ``ContextParallel`` as the sequence backend
(``subquad.layers.sequence``), the one entry point every layer uses to reach across tokens,
and the backend does the cross-rank work. Token-wise work (embeddings, norms, MLPs,
projections) needs nothing; of the backend's calls

- ``attention`` runs as ``ring_attention`` (with its sliding window when it has one);
- ``recurrence`` passes states for every op that declares its state-passing ``Transition``
  (``subquad.ops``: linear attention, retention, simple GLA, GLA, Mamba-2's SSD, the delta
  rules, Mamba's selective scan): each piece's state from zero and its transition are
  all-gathered (O(H K V) per piece, whatever T) and folded in sequence order into each
  piece's true initial state (``seqpar.pass_states``);
- ``causal_conv`` gives each piece the last inputs of the piece before it (a halo);
- ``positions`` are the pieces' global positions (rotary and learned positions).

Equal to one process over the whole sequence, forward and backward (tests/distributed).
Decoding states are not produced: context parallelism is for training and prefill-free
evaluation of long sequences.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from subquad.distributed.ring import ring_attention
from subquad.distributed.seqpar import fold_states, pass_states
from subquad.ops.common.transition import transition_of
from subquad.layers import sequence


def current():
    """The active ``ContextParallel``, or None outside ``context_parallel``."""
    b = sequence.backend()
    return b if isinstance(b, ContextParallel) else None


@contextlib.contextmanager
def context_parallel(group=None):
    """Run the model code inside on this rank's zigzag shard of each sequence (see the module doc)."""
    if not dist.is_initialized():
        raise ValueError("context_parallel needs torch.distributed initialised (torchrun, or init_process_group)")
    with sequence.use(ContextParallel(group)) as cp:
        yield cp


class ContextParallel:
    """The sequence backend of one rank's zigzag shard (see the module docstring)."""

    whole_sequence = False
    cu_seqlens = None

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    # -- layout --------------------------------------------------------------------------------------------
    def _piece_len(self, t: int) -> int:
        if t % 2:
            raise ValueError(f"a rank's shard holds 2 pieces of the sequence, so its length must be even; got {t}")
        return t // 2

    def positions(self, t: int, start=0, device=None) -> torch.Tensor:
        """Global positions (t,) of this rank's t local tokens (a shard always starts a sequence: ``start``
        is 0)."""
        c = self._piece_len(t)
        a, b = self.rank * c, (2 * self.world - 1 - self.rank) * c
        return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])

    def length(self, t: int, start: int = 0) -> int:
        """The zigzag shards cover the whole sequence: P ranks of t tokens each."""
        return self.world * t

    def tokens(self, B: int, t: int, device=None) -> torch.Tensor:
        return torch.full((B,), t, dtype=torch.long, device=device)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, t, ...) local tokens -> (2B, t/2, ...): the two pieces stacked along the batch, piece-major."""
        self._piece_len(x.shape[1])
        return torch.cat(x.chunk(2, dim=1), dim=0)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of ``split``."""
        return torch.cat(x.chunk(2, dim=0), dim=1)

    # -- what the mixers call ------------------------------------------------------------------------------
    def halo(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """For each piece of ``x`` (2B, c, D), the last ``width`` tokens of the piece before it: (2B, width, D).

        Zeros before the first piece, as a causal convolution pads. Needs c >= width.
        """
        if width == 0:
            return x[:, :0]
        if x.shape[1] < width:
            raise ValueError(f"pieces of {x.shape[1]} tokens are shorter than the convolution's reach ({width}); "
                             "use a longer sequence or fewer ranks")
        tails = x[:, x.shape[1] - width:]
        tails = tails.reshape(2, -1, *tails.shape[1:])
        # the halo is a fold with a zero transition: each piece sees only the tail of the one before
        return fold_states(tails, torch.zeros_like(tails), combine="mul", group=self.group).reshape(-1, *tails.shape[2:])

    def causal_conv(self, conv, x: torch.Tensor, reach: int, tail=None):
        """``conv(x, tail) -> (y, tail)`` over this rank's tokens (B, t, D), each piece with the last ``reach``
        inputs of the piece before it; no tail is returned."""
        xp = self.split(x)
        y, _ = conv(xp, self.halo(xp, reach))
        return self.merge(y), None

    def attention(self, q, k, v, *, window=None, scale=None, initial_state=None, mode=None, chunk_size=None,
                  block_size: int = 256, cu_seqlens=None):
        """Causal softmax attention of this rank's tokens (B, t, H, K) against the whole sequence (ring).
        ``mode`` and ``chunk_size`` are the single-device form's and do not apply. Returns (o, None)."""
        if initial_state is not None:
            raise ValueError("context parallelism runs whole sequences: initial_state must be None")
        return ring_attention(q, k, v, causal=True, window=window, scale=scale, group=self.group,
                              block_size=block_size, cu_seqlens=cu_seqlens), None

    def recurrence(self, op, *inputs, initial_state=None, mode=None, chunk_size: int = 64, cu_seqlens=None,
                   **options):
        """``op`` (a recurrent op of ``subquad.ops``, called as on one device) over the whole sequence by
        state passing (its declared ``Transition``); returns (this rank's output, None). ``mode`` does not
        apply (the chunk form runs). Per-token inputs - tensors of shape (B, t, ...) - are split into the
        shard's two pieces; the others (a fixed decay (H,), Mamba's A and D) pass as they are."""
        if initial_state is not None:
            raise ValueError("context parallelism runs whole sequences: initial_state must be None")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of one sequence. "
                         "Shard whole documents instead (data parallelism), or run packed batches on one process")
        if transition_of(op) is None:
            raise ValueError(f"context parallelism has no state passing for op {getattr(op, '__name__', op)!r}: it "
                             "declares no Transition (subquad.ops.common.transition)")
        args = inspect.signature(op).bind(*inputs, **options).arguments
        B, t = inputs[0].shape[:2]
        args = {n: self.split(a) if isinstance(a, torch.Tensor) and a.dim() >= 2 and tuple(a.shape[:2]) == (B, t)
                else a for n, a in args.items()}
        args["chunk_size"] = chunk_size
        return self.merge(pass_states(op, args, pieces=2, group=self.group)), None


__all__ = ["context_parallel", "current", "ContextParallel"]
