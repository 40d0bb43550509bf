"""The selective scan, recurrent form: the token loop (the spec). Without the D skip and the z gate,
which the op applies.

    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t,    y_t = C_t . h_t
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay


def recurrent_scan(x, dt, A, B, C, *, chunk_size=None, initial_state=None):
    Bz, T, Dm = x.shape
    h = x.new_zeros(Bz, Dm, A.shape[1]) if initial_state is None else initial_state
    ys = []
    dtx = (dt * x).unsqueeze(-1)                                               # (B, T, Dm, 1)
    for t in range(T):
        dA = exp_decay(dt[:, t, :, None] * A)                                  # (B, Dm, N)
        h = torch.addcmul(dA * h, dtx[:, t], B[:, t, None, :])                # exp(dt A) h + dt x B
        ys.append(torch.matmul(h, C[:, t, :, None]).squeeze(-1))              # C . h: (B, Dm)
    return torch.stack(ys, 1), h
