"""Unit lower-triangular systems, the WY representation's one solve per chunk, for whole batches of chunks.

    T = A^{-1} for A = I + L, L strictly lower        (N, C, C)
    X_i = T R_i                                       with the gradient dR_i = T^T dX_i,
                                                      dL = -strictly_lower(sum_i dR_i X_i^T)

The inverse is LAPACK's batched trsm applied to the identity (``torch.linalg.solve_triangular``), then
every right-hand side is one bmm. Of the solvers measured (README.md here), this was the fastest at the
chunk sizes the engine uses: the trsm on I costs about a third of a blocked inverse built from
vectorised row recurrences, and forming T once lets the right-hand sides (the keys and the values of
the WY factors) be plain matmuls, where a trsm straight on a wide right-hand side is slower than the
inverse and the matmul together. The backward needs T only: two matmuls per right-hand side, no solve.
"""

from __future__ import annotations

import torch

from subquad.ops.common.precision import autocast_off


def unit_lower_inverse(A):
    """(I + L)^{-1} for a batch of unit lower-triangular A (..., C, C); A's diagonal and upper triangle
    are not read (taken as I's)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)


def _solve(A, R, out):
    """(T, (X_1, ...)): the inverse and T R_i, each written into its ``out`` buffer where one is given."""
    T = unit_lower_inverse(A)
    C = T.shape[-1]
    T3 = T.reshape(-1, C, C)                                           # bmm on flat batches: no copies
    flat = (lambda x: x.reshape(T3.shape[0], C, x.shape[-1]))
    return T, tuple(torch.bmm(T3, flat(r), out=None if o is None else flat(o)).view(r.shape) for r, o in zip(R, out))


class _UnitLowerSolve(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, A, out, *R):
        T, X = _solve(A, R, out)
        ctx.save_for_backward(T, *X)
        return X

    @staticmethod
    @autocast_off
    def backward(ctx, *dX):
        T, *X = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        dR = tuple(torch.matmul(Tt, d) for d in dX)
        dA = sum(torch.matmul(d, x.transpose(-1, -2)) for d, x in zip(dR, X))
        return (dA.tril_(-1).neg_(), None, *dR)


def unit_lower_solve(A, *R, out=None):
    """(X_1, ...) = (A^{-1} R_1, ...) for unit lower-triangular A (..., C, C) and right-hand sides R_i
    (..., C, M_i), differentiable in A's strictly lower part and in every R_i (A's diagonal and upper
    triangle are taken as I's). One inverse serves every right-hand side. ``out``: a buffer (or None) per
    right-hand side to write X_i into, without autograd. Autocast is the caller's (the ops run with it off)."""
    out = out or (None,) * len(R)
    if torch.is_grad_enabled() and (A.requires_grad or any(r.requires_grad for r in R)):
        return _UnitLowerSolve.apply(A, out, *R)
    return _solve(A, R, out)[1]                                        # nothing to record: no Function
