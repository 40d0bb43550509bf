"""Mamba-2 block (Dao & Gu 2024, arXiv:2405.21060): selective SSM computed as SSD (``simple_gla``).

    z, xBC, dt = in_proj(u)                      z, x (B, T, d_inner); B, C (B, T, N); dt (B, T, H)
    x, B, C    = silu(conv1d(xBC))               short causal depthwise conv, its own decoding state
    dt         = softplus(dt + dt_bias);  A = -exp(A_log)   (one per head)
    h_t        = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T       (N, P) per head, P = headdim
    y_t        = C_t . h_t + D x_t
    out        = out_proj(rmsnorm(y * silu(z)))

The recurrence is simple_gla with q = C, k = dt B, v = x, g = dt A, scale 1. In chunk mode it runs
``ssd_chunkwise`` (``ssd_inference`` without a gradient), which computes the products with the shared
B and C once for all heads; the other modes and context parallelism go through simple_gla.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.norm import GatedRMSNorm
from subquad.ops import simple_gla
from subquad.ops.common.autograd import inference_path, wants_grad
from subquad.ops.common.precision import no_autocast
from subquad.ops.common.chunking import SHORT
from subquad.ops.gla.ssd import ssd_chunkwise, ssd_inference


class Mamba2(Mixer):
    """Mamba-2 (SSD): h_t = exp(dt_t A) h_t-1 + dt_t B_t x_t^T per head, y_t = C_t h_t + D x_t, then
    out_proj(rmsnorm(y * silu(z))).

    Args: d_model; d_state N; headdim P (heads = d_inner / P); expand (d_inner = expand d_model); d_conv;
    dt_min, dt_max (dt's initial range); mode; chunk_size.
    State: {"ssm": (B, H, N, P) float32 (float64 for float64), "conv": (B, d_conv - 1, d_inner + 2 N)}.
    """
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer._in_pieces); fastest here
    def __init__(self, d_model: int, d_state: int = 64, headdim: int = 64, expand: int = 2, d_conv: int = 4,
                 dt_min: float = 1e-3, dt_max: float = 0.1, mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.d_inner = expand * d_model
        if self.d_inner % headdim:
            raise ValueError(f"expand * d_model = {self.d_inner} must divide by headdim={headdim}")
        self.d_state, self.headdim = d_state, headdim
        self.n_heads = self.d_inner // headdim
        self.conv_dim = self.d_inner + 2 * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * d_state + self.n_heads, bias=False)
        self.conv = ShortConv(self.conv_dim, d_conv)
        dt = torch.exp(torch.rand(self.n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))        # inverse softplus
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = GatedRMSNorm(self.d_inner)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        return {"ssm": torch.zeros(batch_size, self.n_heads, self.d_state, self.headdim, device=device, dtype=sd),
                "conv": self.conv.empty_state(batch_size, device, dtype)}

    def ssd(self, x, dt, A, Bm, Cm, initial_state, cp=None):
        """x (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, N) -> y (B, T, H, P), h (B, H, N, P).

        Inside a context-parallel run (``cp``), over the whole sequence by state passing, and h is None.
        """
        H = self.n_heads
        if cp is None and self.mode == "chunk" and x.shape[1] >= SHORT:   # B and C shared: one matmul for all heads
            sd = torch.float64 if x.dtype == torch.float64 else torch.float32
            run = ssd_inference if inference_path(x, dt, A, Bm, Cm, initial_state) else ssd_chunkwise
            with no_autocast(x):                                                # float32 inside, as every op
                y, h = run(*(t.to(sd) for t in (x, dt, A, Bm, Cm)), chunk_size=self.chunk_size,
                           initial_state=initial_state)
            return y.to(x.dtype), h
        q = Cm.unsqueeze(2).expand(-1, -1, H, -1)                              # B and C are shared by the heads
        k = Bm.unsqueeze(2).expand(-1, -1, H, -1) * dt.unsqueeze(-1)
        if cp is not None:
            return cp.scan("simple_gla", q, k, x, g=dt * A, scale=1.0, chunk_size=self.chunk_size), None
        return simple_gla(q, k, x, dt * A, mode=self.mode, chunk_size=self.chunk_size, scale=1.0,
                          initial_state=initial_state, output_final_state=True)

    def forward(self, u, state=None):
        self._check_x(u)
        pieces = self._in_pieces(u, state)
        if pieces is not None:
            return pieces
        Bsz, T, _ = u.shape
        H, P, N = self.n_heads, self.headdim, self.d_state
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.conv_dim, H], dim=-1)
        cp = self._context(state)
        if cp is not None:
            xBC, conv_state = cp.conv(self.conv, xBC), None
        else:
            xBC, conv_state = self.conv(xBC, None if state is None else state["conv"])
        xBC = F.silu(xBC, inplace=cp is None and not wants_grad(xBC))    # in place on the conv's fresh output
        x, Bm, Cm = torch.split(xBC, [self.d_inner, N, N], dim=-1)
        dt = F.softplus(dt + self.dt_bias)                                    # (B, T, H)
        A = -torch.exp(self.A_log)                                            # (H,)
        x = x.view(Bsz, T, H, P)
        y, h = self.ssd(x, dt, A, Bm, Cm, None if state is None else state["ssm"], cp)
        y = torch.addcmul(y, x, self.D.view(1, 1, H, 1))
        out = self.project_out(y.reshape(Bsz, T, self.d_inner), z)
        return out, None if cp is not None else {"ssm": h, "conv": conv_state}

    def project_out(self, y, z):
        """out_proj(norm(y, z)). With one norm group, the norm's row scale commutes with out_proj and its
        weight folds into out_proj's, so both apply to the d_model-wide output, not the d_inner-wide input."""
        if self.norm.group_size != self.d_inner or self.out_proj.bias is not None:
            return self.out_proj(self.norm(y, z))
        g = self.norm.gate(y, z)
        out = F.linear(g, self.out_proj.weight * self.norm.weight)    # 16-bit under autocast, as out_proj's
        return out * self.norm.inv_rms(g).to(out.dtype)
