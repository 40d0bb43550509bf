"""The three forms of the selective scan (without the D skip and the z gate, applied by the caller).

recurrent: the token loop (the spec).

parallel: the decayed T x T form per channel and state dim, for short T only:
    Lam_t = sum_{r<=t} dt_r A                       (cumulative log-decay, (B, T, Dm, N))
    y_t   = sum_n C_t[n] (sum_{s<=t} exp(Lam_t - Lam_s)[n] dt_s B_s[n] x_s + exp(Lam_t)[n] h_0[n])

chunk: "lanes". The sequence is cut into n = ceil(T / C) lanes of C tokens, and
the work runs over the C positions of a lane with every lane at once:
    1. local scan: each lane from a zero state, positions 0..C-1, all lanes in one tensor op
       per position; keeps only each lane's final local state and its total decay
    2. state passing: lane i starts from h_i = exp(Lam_lane_{i-1}) h_{i-1} + local_{i-1} (n steps of (B, Dm, N))
    3. output: the C positions again, now from the true starting states, contracting with C_t
       as it goes, so no (T, Dm, N) tensor is ever formed (the largest is (B, n, Dm, N))
A Mamba-1 decay differs per channel *and* state dim, so the intra-chunk products
are not matmuls (unlike SSD); the scan is elementwise work O(T Dm N) either way,
and this keeps it in 2C + n vectorised steps instead of T.
Every factor is exp of a log-decay <= 0: nothing overflows at dt * A = -50.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent_selective_scan(x, dt, A, B, C, *, chunk_size=None, initial_state=None):
    Bsz, T, Dm = x.shape
    h = x.new_zeros(Bsz, Dm, A.shape[1]) if initial_state is None else initial_state
    ys = []
    for t in range(T):
        dA = torch.exp(dt[:, t, :, None] * A)                                  # (B, Dm, N)
        h = dA * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def parallel_selective_scan(x, dt, A, B, C, *, chunk_size=None, initial_state=None):
    T = x.shape[1]
    lam = torch.cumsum(dt[..., None] * A, dim=1)                              # (B, T, Dm, N)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    diff = lam[:, :, None] - lam[:, None, :]                                  # (B, T, S, Dm, N)
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None, None], float("-inf")))
    u = (dt * x)[..., None] * B[:, :, None, :]                                # (B, S, Dm, N)
    h = torch.einsum("btsdn,bsdn->btdn", decay, u)
    if initial_state is not None:
        h = h + torch.exp(lam) * initial_state[:, None]
    y = torch.einsum("btdn,btn->btd", h, C)
    return y, h[:, -1]


def chunk_selective_scan(x, dt, A, B, C, *, chunk_size=64, initial_state=None):
    Bsz, T, Dm = x.shape
    N = A.shape[1]
    c = min(chunk_size, T)
    n = -(-T // c)
    pad = n * c - T
    if pad:  # zero-padding at the end: dt = 0 there, so it neither decays nor writes the state
        x, dt = F.pad(x, (0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        B, C = F.pad(B, (0, 0, 0, pad)), F.pad(C, (0, 0, 0, pad))
    xl, dtl = x.view(Bsz, n, c, Dm), dt.view(Bsz, n, c, Dm)                  # lanes
    Bl, Cl = B.view(Bsz, n, c, N), C.view(Bsz, n, c, N)

    def decay(j):
        return torch.exp(dtl[:, :, j, :, None] * A)                          # (B, n, Dm, N)

    def write(j):
        return (dtl[:, :, j] * xl[:, :, j])[..., None] * Bl[:, :, j, None, :]

    # 1. local scan of every lane from zero
    h = write(0)
    for j in range(1, c):
        h = decay(j) * h + write(j)
    total = torch.exp(dtl.sum(2)[..., None] * A)                              # exp(sum_j dt_j A) per lane
    # 2. state passing between lanes
    starts = []
    s = x.new_zeros(Bsz, Dm, N) if initial_state is None else initial_state
    for i in range(n):
        starts.append(s)
        s = total[:, i] * s + h[:, i]
    final = s
    # 3. outputs from the true starting states
    h = torch.stack(starts, 1)                                                # (B, n, Dm, N)
    ys = []
    for j in range(c):
        h = decay(j) * h + write(j)
        ys.append(torch.einsum("bldn,bln->bld", h, Cl[:, :, j]))
    y = torch.stack(ys, 2).reshape(Bsz, n * c, Dm)[:, :T]
    return y, final
