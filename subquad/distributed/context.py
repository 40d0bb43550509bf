"""Context parallelism for a whole model: one sequence split over the P ranks of a process group.

    with context_parallel(group) as cp:
        logits = model(zigzag_shard(idx, cp.rank, cp.world))     # this rank's 2c of the T = 2Pc tokens

Layout (zigzag, as ring attention's): the sequence is cut into 2P pieces of c tokens and
rank r holds pieces r and 2P-1-r, in that order. Token-wise work (embeddings, norms,
MLPs, projections) needs nothing; the mixers ask ``current()`` and then

- softmax attention runs as ``ring_attention`` (with its sliding window when it has one);
- recurrent mixers (linear attention and its feature maps, retention, GLA, Mamba-2's SSD,
  the delta rules, Mamba's selective scan) pass states: each piece's state from zero
  and its transition are all-gathered (O(H K V) per piece, whatever T) and folded in
  sequence order into each piece's true initial state (``fold_states``);
- short convolutions take the last W-1 inputs of the piece before each piece (a halo);
- rotary and learned positions use the pieces' global positions (``positions``).

Equal to one process over the whole sequence, forward and backward (tests/distributed).
Decoding states are not produced: context parallelism is for training and prefill-free
evaluation of long sequences.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from subquad.distributed.ring import ring_attention
from subquad.distributed.seqpar import fold_states, state_passing

_ACTIVE: list = []


def current():
    """The active ``ContextParallel``, or None outside ``context_parallel``."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def context_parallel(group=None):
    """Run the model code inside on this rank's zigzag shard of each sequence (see the module doc)."""
    if not dist.is_initialized():
        raise ValueError("context_parallel needs torch.distributed initialised (torchrun, or init_process_group)")
    cp = ContextParallel(group)
    _ACTIVE.append(cp)
    try:
        yield cp
    finally:
        _ACTIVE.pop()


class ContextParallel:
    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    # -- layout --------------------------------------------------------------------------------------------
    def _piece_len(self, t: int) -> int:
        if t % 2:
            raise ValueError(f"a rank's shard holds 2 pieces of the sequence, so its length must be even; got {t}")
        return t // 2

    def positions(self, t: int, device=None) -> torch.Tensor:
        """Global positions (t,) of this rank's t local tokens."""
        c = self._piece_len(t)
        a, b = self.rank * c, (2 * self.world - 1 - self.rank) * c
        return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])

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

    def conv(self, conv, x: torch.Tensor) -> torch.Tensor:
        """A ``ShortConv`` over this rank's tokens (B, t, D) with the halo from the pieces before."""
        xp = self.split(x)
        y, _ = conv(xp, self.halo(xp, conv.kernel_size - 1))
        return self.merge(y)

    def attention(self, q, k, v, *, window=None, scale=None, block_size: int = 256):
        """Causal softmax attention of this rank's tokens (B, t, H, K) against the whole sequence (ring)."""
        return ring_attention(q, k, v, causal=True, window=window, scale=scale, group=self.group,
                              block_size=block_size)

    def scan(self, kind: str, q, k, v, *, g=None, beta=None, normalize: bool = False, scale=None,
             chunk_size: int = 64):
        """``kind`` (see ``subquad.distributed.seqpar.KINDS``) over the whole sequence; this rank's o (B, t, H, V)."""
        sp = self.split
        g = g if g is None or g.dim() == 1 else sp(g)
        o = state_passing(kind, sp(q), sp(k), sp(v), g=g, beta=None if beta is None else sp(beta),
                          normalize=normalize, scale=scale, chunk_size=chunk_size, group=self.group, pieces=2)
        return self.merge(o)

    def selective_scan(self, x, dt, A, Bm, Cm, *, D=None, z=None, chunk_size: int = 64):
        """Mamba's selective scan over the whole sequence; this rank's y (B, t, Dm).

        The state (B, Dm, N) passes with an elementwise transition exp(A * sum_t dt_t) per piece.
        """
        from subquad.ops import selective_scan

        sp = self.split
        x, dt, Bm, Cm = sp(x), sp(dt), sp(Bm), sp(Cm)
        z = None if z is None else sp(z)

        def run(h0):
            return selective_scan(x, dt, A, Bm, Cm, D=D, z=z, mode="chunk", chunk_size=chunk_size,
                                  initial_state=h0, output_final_state=True)

        _, h = run(None)                                                      # (2B, Dm, N)
        M = torch.exp(A.unsqueeze(0) * dt.sum(1).to(A.dtype).unsqueeze(-1))    # decay over the whole piece
        h0 = fold_states(h.reshape(2, -1, *h.shape[1:]), M.reshape(2, -1, *M.shape[1:]), combine="mul",
                         group=self.group)
        y, _ = run(h0.reshape(h.shape))
        return self.merge(y)


__all__ = ["context_parallel", "current", "ContextParallel"]
