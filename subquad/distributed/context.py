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
- ``recurrence`` passes states for every op with an affine state update (linear attention,
  retention, simple GLA, GLA, Mamba-2's SSD, the delta rules, Mamba's selective scan): each
  piece's state from zero and its transition are all-gathered (O(H K V) per piece, whatever
  T) and folded in sequence order into each piece's true initial state (``fold_states``);
- ``causal_conv`` gives each piece the last inputs of the piece before it (a halo);
- ``positions`` are the pieces' global positions (rotary and learned positions).

Equal to one process over the whole sequence, forward and backward (tests/distributed).
Decoding states are not produced: context parallelism is for training and prefill-free
evaluation of long sequences.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import inspect

from subquad.distributed.ring import ring_attention
from subquad.distributed.seqpar import KINDS, fold_states, state_passing
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
        state passing; returns (this rank's output, None). ``mode`` does not apply (the chunk form runs)."""
        if initial_state is not None:
            raise ValueError("context parallelism runs whole sequences: initial_state must be None")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of one sequence. "
                         "Shard whole documents instead (data parallelism), or run packed batches on one process")
        name = getattr(op, "__name__", repr(op))
        if name not in KINDS + ("ssd", "selective_scan"):
            raise ValueError(f"context parallelism has no state passing for op {name!r}; it has "
                             f"{', '.join(KINDS + ('ssd', 'selective_scan'))}")
        a = inspect.signature(op).bind(*inputs, **options).arguments
        if name == "selective_scan":
            return self.selective_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a.get("D"), z=a.get("z"),
                                       chunk_size=chunk_size), None
        if name == "ssd":
            return self.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a.get("D"), chunk_size=chunk_size), None
        return self.scan(name, a["q"], a["k"], a["v"], g=a.get("g"), beta=a.get("beta"),
                         normalize=a.get("normalize", False), scale=a.get("scale"), chunk_size=chunk_size,
                         allow_neg_eigval=a.get("allow_neg_eigval", False)), None

    def ssd(self, x, dt, A, B, C, *, D=None, chunk_size: int = 64):
        """Mamba-2's SSD as simple GLA (q = C, k = dt B, g = dt A, scale 1, shared by the heads)."""
        from subquad.ops.decay import ssd_as_gla

        H = x.shape[2]
        q, k, g = ssd_as_gla(x, dt, A, B, C)
        y = self.scan("simple_gla", q, k, x, g=g, scale=1.0, chunk_size=chunk_size)
        return y if D is None else torch.addcmul(y, x, D.to(y.dtype).view(1, 1, H, 1))

    def scan(self, kind: str, q, k, v, *, g=None, beta=None, normalize: bool = False, scale=None,
             chunk_size: int = 64, allow_neg_eigval: bool = False):
        """``kind`` (see ``subquad.distributed.seqpar.KINDS``) over the whole sequence; this rank's o (B, t, H, V)."""
        sp = self.split
        g = g if g is None or g.dim() == 1 else sp(g)
        o = state_passing(kind, sp(q), sp(k), sp(v), g=g, beta=None if beta is None else sp(beta),
                          normalize=normalize, scale=scale, chunk_size=chunk_size, group=self.group, pieces=2,
                          allow_neg_eigval=allow_neg_eigval)
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
