"""Unit lower-triangular systems, the WY representation's one solve per chunk, for whole batches of chunks.

    T = A^{-1} for A = I + L, L strictly lower        (N, C, C)
    X = A^{-1} R                                      with its gradient: dR = T^T dX, dL = -strictly_lower(dR X^T)

LAPACK's batched trsm has a per-matrix overhead that dominates for small C, and autograd's backward
of ``linalg.solve_triangular`` is a second batched solve; these are ~25 vectorised ops for the whole
batch (timings in benchmarks/RESULTS.md, the delta rule's section).
"""

from __future__ import annotations

import torch
from subquad.ops.common.precision import autocast_off

BASE = 16  # diagonal blocks of the inverse built by the row recurrence


def _diagonal_blocks(A, s):
    """The diagonal blocks of s rows of A (N, C, C) as (N, C / s, s, s) (a view)."""
    N, C, _ = A.shape
    return torch.diagonal(A.view(N, C // s, s, C // s, s), dim1=1, dim2=3).permute(0, 3, 1, 2)


def unit_lower_inverse(A):
    """(I + L)^{-1} for a batch of unit lower-triangular A = I + L (N, C, C).

    ~25 vectorised ops for the whole batch (see the module docstring). A is padded with the identity to BASE * 2^m rows; the diagonal blocks of BASE rows come
    from the row recurrence T[i, :i] = -L[i, :i] T[:i, :i] (as in flash-linear-attention's reference),
    all blocks at once; then neighbouring blocks are merged, [[T1, 0], [-T2 L21 T1, T2]], doubling the
    block size until it covers the matrix."""
    N, C, _ = A.shape
    Cp = BASE
    while Cp < C:
        Cp *= 2
    if Cp != C:
        A = torch.nn.functional.pad(A, (0, Cp - C, 0, Cp - C))
        A[:, C:, C:].diagonal(dim1=1, dim2=2).fill_(1)
    T = _diagonal_blocks(A, BASE).reshape(-1, BASE, BASE).tril(-1).neg_()
    for i in range(1, BASE):
        T[:, i, :i] += (T[:, i, :, None] * T[:, :, :i]).sum(-2)
    T.diagonal(dim1=1, dim2=2).fill_(1)
    size = BASE
    while size < Cp:                                                  # merge pairs of blocks of `size` rows
        m = Cp // (2 * size)
        T = T.view(N, m, 2, size, size)
        merged = A.new_zeros(N, m, 2 * size, 2 * size)
        L21 = _diagonal_blocks(A, 2 * size)[:, :, size:, :size]
        merged[:, :, :size, :size] = T[:, :, 0]
        merged[:, :, size:, size:] = T[:, :, 1]
        merged[:, :, size:, :size] = -(T[:, :, 1] @ L21 @ T[:, :, 0])
        T = merged.view(N * m, 2 * size, 2 * size)
        size *= 2
    return T.view(N, Cp, Cp)[:, :C, :C]


class _UnitLowerSolve(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, A, R):
        T = unit_lower_inverse(A)
        X = T @ R
        ctx.save_for_backward(T, X)
        return X

    @staticmethod
    @autocast_off
    def backward(ctx, dX):
        T, X = ctx.saved_tensors
        dR = T.transpose(-1, -2) @ dX
        dA = -(dR @ X.transpose(-1, -2)).tril_(-1)
        return dA, dR


def unit_lower_solve(A, R):
    """X = A^{-1} R for unit lower-triangular A (..., C, C) and R (..., C, M), differentiable in A's
    strictly lower part and in R (A's diagonal and upper triangle are taken as I's)."""
    shape = A.shape
    X = _UnitLowerSolve.apply(A.reshape(-1, *shape[-2:]), R.reshape(-1, *R.shape[-2:]))
    return X.view(*R.shape)
