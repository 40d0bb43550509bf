"""Mamba-2 block (Dao & Gu 2024, arXiv:2405.21060): selective SSM computed as SSD (``simple_gla``).

    z, xBC, dt = in_proj(input)                     z, x (B, T, d_inner); B, C (B, T, N); dt (B, T, H)
    x, B, C    = silu(conv1d(xBC))               short causal depthwise conv, its own decoding state
    dt         = softplus(dt + dt_bias);  A = -exp(A_log)   (one per head)
    h_t        = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T       (N, P) per head, P = head_dim
    y_t        = C_t . h_t + D x_t
    out        = out_proj(rmsnorm(y * silu(z)))          (gated_norm=False: out_proj(y * silu(z)), Falcon-H1's)

The recurrence is the ``ssd`` op (``simple_gla`` with q = C, k = dt B, v = x, g = dt A, scale 1, with B
and C shared by the heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.layers import sequence
from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.mamba import block_backend, block_projections, checked, planned_block
from subquad.layers.norm import GatedRMSNorm
from subquad.layers.sequence import SingleDevice
from subquad.ops import ssd
from subquad.ops.decay import fused_block, fused_step


class Mamba2(Mixer):
    """Mamba-2 (SSD): h_t = exp(dt_t A) h_t-1 + dt_t B_t x_t^T per head, y_t = C_t h_t + D x_t, then
    out_proj(rmsnorm(y * silu(z))).

    Args: d_model; d_state N; head_dim P (heads = d_inner / P); expand (d_inner = expand d_model); conv_size
    (the short convolution's width); n_groups G (B and C per group of H / G heads, and the gated norm per
    group); norm_eps (the gated norm's); gated_norm (False: no norm, out_proj(y * silu(z)) - Falcon-H1's
    ``mamba_rms_norm=false``); d_inner (the inner width when not expand * d_model: Falcon-H1's ``mamba_d_ssm``);
    dt_limit (dt clamped to this range after softplus); dt_min, dt_max
    (dt's initial range); mode; chunk_size.
    State: {"ssm": (B, H, N, P) float32 (float64 for float64), "conv": (B, conv_size - 1, d_inner + 2 G N)}.
    """
    normed_output = True
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best
    def __init__(self, d_model: int, d_state: int = 64, head_dim: int = 64, expand: int = 2, conv_size: int = 4,
                 n_groups: int = 1, norm_eps: float = 1e-6, dt_limit: tuple = (0.0, float("inf")),
                 dt_min: float = 1e-3, dt_max: float = 0.1, gated_norm: bool = True, d_inner: int | None = None,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        if d_inner is not None and (isinstance(d_inner, bool) or not isinstance(d_inner, int) or d_inner < 1):
            raise ValueError(f"d_inner must be a positive int or None (expand * d_model), got {d_inner!r}")
        if not isinstance(gated_norm, bool):
            raise ValueError(f"gated_norm must be a bool, got {gated_norm!r}")
        self.d_inner = expand * d_model if d_inner is None else d_inner
        self.normed_output = gated_norm
        if self.d_inner % head_dim:
            raise ValueError(f"the inner width {self.d_inner} (expand * d_model, or d_inner) must divide by "
                             f"head_dim={head_dim}")
        self.d_state, self.head_dim = d_state, head_dim
        self.n_heads = self.d_inner // head_dim
        if n_groups < 1 or self.n_heads % n_groups:
            raise ValueError(f"n_groups={n_groups} must divide the {self.n_heads} heads")
        self.n_groups, self.dt_limit = n_groups, tuple(dt_limit)
        self.conv_dim = self.d_inner + 2 * n_groups * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * n_groups * d_state + self.n_heads, bias=False)
        self.conv = ShortConv(self.conv_dim, conv_size)
        dt = torch.exp(torch.rand(self.n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))        # inverse softplus
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = GatedRMSNorm(self.d_inner, norm_eps, group_size=self.d_inner // n_groups) if gated_norm else None
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def mix_flops(self, T):
        """The write dt B x^T and the read C h per head, N x P."""
        return 4.0 * self.n_heads * self.d_state * self.head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"ssm": self.zeros(batch_size, self.n_heads, self.d_state, self.head_dim, device=device, dtype=dtype),
                "conv": self.conv.empty_state(batch_size, device, dtype)}

    # Its states per token (``layers.rollback.PerToken``, a verification) come in one call only through its
    # pre-norm block's (``fused_block``: ``TokensStep``); ``models.speculative`` asks the block (``per_token_states``)
    block_tokens = True

    @property
    def per_token_states(self) -> bool:
        """Whether its pre-norm block can keep its states per token in one call (``TokensStep``: float32 on the
        CPU, kernels on and built); the layer alone would loop over the tokens."""
        return self.A_log.dtype == torch.float32 and self.A_log.is_cpu and kernels.enabled() \
            and fused_block.TOKENS.available()

    def _fusable(self, kernel, x, state, seq, *tensors, backend=SingleDevice) -> bool:
        """Whether one decoding token may take ``kernel`` (the layer's step or its block's, float32 on the CPU, no
        gradient; ``kernels.usable``) with the layer's weights and ``tensors``; ``backend``: the sequence backend
        it runs under (``PerToken`` for a verification's tokens)."""
        return state is not None and type(seq) is backend \
            and kernels.usable(kernel, x, state["ssm"], state["conv"], self.A_log, self.D, self.dt_bias,
                               self.conv.weight, self.conv.bias, None if self.norm is None else self.norm.weight,
                               *tensors)

    def mix(self, x, state, seq):
        if self._fusable(fused_step.KERNEL, x, state, seq):
            return self._fused_step(x, state)       # one decoding token: the kernel (float32 CPU, no gradient)
        B, T, _ = x.shape
        H, P, N = self.n_heads, self.head_dim, self.d_state
        z, xBC, dt = torch.split(self.in_proj(x), [self.d_inner, self.conv_dim, H], dim=-1)
        xBC, conv = self.short_conv(xBC, state, seq, activation="silu")
        G = self.n_groups
        xs, Bm, Cm = torch.split(xBC, [self.d_inner, G * N, G * N], dim=-1)
        if G > 1:                                                             # (B, T, G, N): per group of heads
            Bm, Cm = Bm.view(B, T, G, N), Cm.view(B, T, G, N)
        dt = F.softplus(dt + self.dt_bias)                                    # (B, T, H)
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        A = -torch.exp(self.A_log)                                            # (H,)
        y, h = seq.recurrence(ssd, xs.view(B, T, H, P), dt, A, Bm, Cm, D=self.D, mode=self.mode,
                              chunk_size=self.chunk_size, initial_state=None if state is None else state["ssm"])
        return self.project_out(y.reshape(B, T, self.d_inner), z), {"ssm": h, "conv": conv}

    def fused_block(self, h, norm, state):
        """A pre-norm block's whole decoding step, h + mix(norm(h)), in one call (``ops.decay.fused_block``):
        h (B, 1, d_model) -> (h', new state), or None where it does not apply (``layers.mamba.block_projections``,
        or what keeps the layer's own fused step from running). Under ``layers.rollback.PerToken`` (a
        verification), h (B, T, d_model) -> (h', the states after every token) the same way (``TokensStep``).
        The call is kept between tokens (``layers.mamba.planned_block``)."""
        return planned_block(self, h, norm, state, fused_block.KERNEL, self._block_step)

    def _block_step(self, h, norm, state):
        """``fused_block``'s ``ops.decay.fused_block.BlockStep`` for h's rows (``TokensStep`` for T > 1 tokens
        each), or None where it does not apply."""
        B, T, d = h.shape
        proj = block_projections(self, h.reshape(B * T, 1, d), norm)          # the products' rows: B T
        if proj is None or not self._fusable(fused_block.KERNEL, h[:, :1], state, sequence.backend(),
                                             *checked(proj), backend=block_backend(T)):
            return None
        gn = self.norm
        nw, w_in, b_in, w_out, b_out = proj
        weights = (nw, norm.eps, w_in, b_in, w_out, b_out, self.conv.weight, self.conv.bias, self.dt_bias,
                   self.A_log, self.D, None if gn is None else gn.weight, self.d_inner, self.d_state, self.n_groups,
                   self.d_inner if gn is None else gn.group_size, 0.0 if gn is None else gn.eps, self.dt_limit)
        return fused_block.BlockStep(B, *weights) if T == 1 else fused_block.TokensStep(T, B, *weights)

    def _fused_step(self, x, state):
        """One token through ``ops.decay.fused_step`` (the same math as ``mix``'s ops, in one call; with one norm
        group the row scale applies after out_proj, as ``project_out`` orders it)."""
        norm = self.norm
        defer = norm is not None and norm.group_size == self.d_inner and self.out_proj.bias is None
        out, inv, conv, h = fused_step.mamba2_step(
            self.in_proj(x), state["conv"], self.conv.weight, self.conv.bias, self.dt_bias, self.A_log, self.D,
            state["ssm"], None if norm is None else norm.weight, self.n_groups,
            self.d_inner if norm is None else norm.group_size, 0.0 if norm is None else norm.eps, self.dt_limit, defer)
        y = self.out_proj(out[:, None])
        return (y * inv[:, None] if defer else y), {"ssm": h, "conv": conv}

    def project_out(self, y, z):
        """out_proj(norm(y, z)). With one norm group, the norm's row scale commutes with out_proj, so it
        applies to the d_model-wide output, not the d_inner-wide input; with more tokens than d_model, the
        norm's weight folds into out_proj's too (a pass over the weight costs less than one over the
        tokens; decoding a few tokens, it does not). Without the norm: out_proj(y * silu(z))."""
        if self.norm is None:
            return self.out_proj(GatedRMSNorm.gate(y, z))
        if self.norm.group_size != self.d_inner or self.out_proj.bias is not None:
            return self.out_proj(self.norm(y, z))
        g = self.norm.gate(y, z)
        if g.numel() // g.shape[-1] > self.out_proj.out_features:
            out = F.linear(g, self.out_proj.weight * self.norm.weight)    # 16-bit under autocast, as out_proj's
        else:
            out = self.out_proj(g * self.norm.weight)
        return out * self.norm.inv_rms(g).to(out.dtype)
