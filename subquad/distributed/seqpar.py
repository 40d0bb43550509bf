"""Sequence parallelism for the recurrent mixers by state passing.

Rank r holds the r-th contiguous piece of the sequence. Every mixer here has a
state that is an *affine* function of the state it starts from:

    S_out = M_r S_in + S_r          M_r (B, H, K, K): the piece's transition; S_r: its state from zero

(M_r is the identity for linear attention, a diagonal of decays for retention,
GLA, SSD and Mamba, prod a (I - b k k^T) for the delta rule.) Each rank computes
S_r and M_r with the op itself, as its declared ``Transition`` says
(``subquad.ops.common.transition``) - S_r from a zero state, M_r as the final state
of zero values from the identity or from ones - all-gathers them (a message of at
most H K (K + V) numbers, whatever the length), folds the pieces before it into its
true initial state, and runs its piece from there. The all-gather is differentiable, so backward works as is.
Communication per rank is O(H K V) against ring attention's O(T d).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from subquad import ops
from subquad.ops.common.precision import autocast_off
from subquad.ops.common.transition import transition_of

# the q, k, v ops ``sequence_parallel`` takes by name: every recurrent op with a declared transition
KINDS = tuple(n for n in ops.RECURRENT_OPS if ops.transition_of(getattr(ops, n)) is not None
              and "q" in inspect.signature(getattr(ops, n)).parameters)


class _AllGather(torch.autograd.Function):
    """all_gather with a backward that works on gloo too: all-reduce the gradients, keep this rank's."""

    @staticmethod
    @autocast_off
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x, group=None):
    """Differentiable all-gather: (W, *x.shape)."""
    return _AllGather.apply(x, group)


def fold_states(S, M=None, *, combine: str = "matmul", group=None):
    """The true initial state of each of this rank's pieces, from every piece's own (S, M).

    S (n, B, ...) are this rank's pieces' final states from a zero state, M (n, B, ...) their transitions
    (None: the identity). n = 1: rank r holds piece r of P (contiguous); n = 2: rank r holds pieces r and
    2P-1-r of 2P (the zigzag layout of ring attention). ``combine``: "matmul" (M @ S, K x K transitions) or
    "mul" (elementwise decays). Returns (n, B, ...): for each piece, the fold of every piece before it.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = S.shape[0]
    if n not in (1, 2):
        raise ValueError(f"each rank holds 1 (contiguous) or 2 (zigzag) pieces, got {n}")
    S_all = all_gather(S, group)                                             # (W, n, B, ...)
    M_all = all_gather(M, group) if M is not None else None
    order = [(r, 0) for r in range(world)] + ([(r, 1) for r in reversed(range(world))] if n == 2 else [])
    prefix = [torch.zeros_like(S[0])]
    for r, s in order[:-1]:                                                  # pieces in sequence order
        prev = prefix[-1]
        if M_all is not None:
            prev = M_all[r, s] @ prev if combine == "matmul" else M_all[r, s] * prev
        prefix.append(prev + S_all[r, s])
    out = torch.stack([prefix[order.index((rank, s))] for s in range(n)])
    # Every rank must take part in the gathers' backward (a collective), even one that uses none of the
    # gathered states (rank 0 of a contiguous layout): tie them to the result with weight zero.
    return out + 0.0 * (S_all.sum() + (M_all.sum() if M_all is not None else 0.0))


def pass_states(op, args: dict, *, pieces: int = 1, group=None):
    """``op`` (a recurrent op of ``subquad.ops`` with a declared ``Transition``) over this rank's ``pieces``
    pieces of the sequence, stacked along the batch (piece-major; see ``fold_states``).

    ``args``: the op's arguments by name (its per-token tensors already this rank's pieces). Runs the chunk
    form three times - the pieces' states from zero, their transitions (``ops.common.transition``: the op
    on zero values from the identity or ones), and the outputs from the folded true initial states.
    Returns the op's output for this rank's pieces.
    """
    tr = transition_of(op)
    if tr is None:
        raise ValueError(f"op {getattr(op, '__name__', op)!r} declares no state-passing transition (subquad.ops)")
    if args.get("initial_state") is not None:
        raise ValueError("state passing runs whole sequences: initial_state must be None")
    values = args[tr.values]
    normalize = bool(tr.normaliser and args.get(tr.normaliser))
    if normalize:                                     # the normaliser rides as an extra value column
        values = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)
    base = {**args, "mode": "chunk", "output_final_state": True}
    if tr.normaliser:
        base[tr.normaliser] = False

    def run(vals, state):
        return op(**{**base, tr.values: vals, "initial_state": state})

    _, S_local = run(values, None)                    # (n B, ...): each piece's state from zero
    nB = S_local.shape[0]
    if nB % pieces:
        raise ValueError(f"the batch ({nB}) must stack {pieces} pieces")
    if tr.kind == "identity":
        M = None
    elif tr.kind == "diagonal":                       # elementwise decays: the zero-input state from ones
        _, M = run(torch.zeros_like(values), torch.ones_like(S_local))
    else:                                             # (K, K) per head: the zero-input state from the identity
        K = S_local.shape[-2]
        eye = torch.eye(K, dtype=S_local.dtype, device=S_local.device).expand(*S_local.shape[:-1], K).contiguous()
        _, M = run(values.new_zeros(*values.shape[:-1], K), eye)
    split = lambda t: t.reshape(pieces, nB // pieces, *t.shape[1:])
    S_in = fold_states(split(S_local), None if M is None else split(M),
                       combine="matmul" if tr.kind == "matrix" else "mul", group=group)
    o, _ = run(values, S_in.reshape(S_local.shape))
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + args.get("eps", 1e-6))
    return o


def state_passing(kind: str, q, k, v, *, g=None, beta=None, w=None, a=None, b=None, normalize: bool | None = None,
                  scale=None, chunk_size: int = 64, group=None, pieces: int = 1, allow_neg_eigval: bool = False):
    """``kind`` (an op name of ``KINDS``) over this rank's ``pieces`` pieces, stacked along the batch.

    q, k (n B, t, H, K), v (n B, t, H, V), g / beta (and the generalized delta rule's w, a, b) likewise
    (retention's g (H,) as is); each op's own (``subquad.ops``), the ones it requires refused by name when
    missing. ``normalize``: linear attention's normaliser, None its default (True, as ``ops.linear_attention``).
    ``allow_neg_eigval``: the delta rules' beta in [0, 2]. Returns o (n B, t, H, V).
    """
    if not dist.is_initialized():
        raise ValueError("sequence parallelism needs torch.distributed initialised (torchrun, or init_process_group)")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if normalize and kind != "linear_attention":
        raise ValueError("normalize=True applies to kind='linear_attention' only")
    if allow_neg_eigval and kind not in ("delta_rule", "gated_delta_rule"):
        raise ValueError(f"allow_neg_eigval applies to the delta rules only, not kind={kind!r}")
    op = getattr(ops, kind)
    sig = inspect.signature(op)
    args = sig.bind_partial(q, k, v).arguments
    if normalize is None and "normalize" in sig.parameters:        # the op's own default, said to pass_states
        normalize = sig.parameters["normalize"].default
    given = {"g": g, "beta": beta, "w": w, "a": a, "b": b}
    for name, value in given.items():
        if value is not None and name not in sig.parameters:
            raise ValueError(f"kind={kind!r} takes no {name} (its op: {', '.join(sig.parameters)})")
    for name, param in sig.parameters.items():         # every argument the op requires past q, k, v
        if name not in args and param.default is inspect.Parameter.empty and given.get(name) is None:
            raise ValueError(f"kind={kind!r} needs {name} (an argument of its op, subquad.ops.{kind})")
    for name, value in (*given.items(), ("normalize", normalize), ("scale", scale),
                        ("allow_neg_eigval", allow_neg_eigval)):
        if name in sig.parameters and value is not None:
            args[name] = value
    return pass_states(op, {**args, "chunk_size": chunk_size}, pieces=pieces, group=group)
def sequence_parallel(kind: str, q, k, v, *, g=None, beta=None, w=None, a=None, b=None,
                      normalize: bool | None = None, scale=None, chunk_size: int = 64, group=None, cu_seqlens=None,
                      allow_neg_eigval: bool = False):
    """This rank's outputs (B, t, H, V) of ``kind`` over the sequence split contiguously across ``group``.

    q, k (B, t, H, K), v (B, t, H, V), and per-token gates (g, beta, the generalized delta rule's w, a, b:
    (B, t, H[, K])) are this rank's piece; retention's g (H,) is the same on every rank. ``normalize`` (linear
    attention only; None: the op's default, True) carries the normaliser as an extra value column.
    ``cu_seqlens`` is refused (a rank's piece is part of one sequence).
    """
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of one sequence. "
                         "Shard whole documents instead (data parallelism), or run packed batches on one process")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return state_passing(kind, q, k, v, g=g, beta=beta, w=w, a=a, b=b, normalize=normalize, scale=scale,
                         chunk_size=chunk_size, group=group, pieces=1, allow_neg_eigval=allow_neg_eigval)
