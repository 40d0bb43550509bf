"""RWKV-7 "Goose" time mix (Peng et al. 2025, arXiv:2503.14456): the generalised delta rule with a decay per
key channel, fed by token-shifted projections and low-rank gates.

    dx          = x_{t-1} - x_t                                  token shift (``shift.token_shift``), its own state
    x_r .. x_g  = x + dx * mu_r .. mu_g                          six learned mixes, (D,) each
    r, k, v     = W_r x_r, W_k x_k, W_v x_v                      (B, T, H, K), K = head_dim, V = K
    w           = -e^{-1/2} sigmoid(w0 + tanh(x_w W1) W2)        log-decay per key channel, in (-0.607, 0)
    lr          = sigmoid(a0 + x_a A1 A2)                        in-context learning rate per key channel
    g           = sigmoid(x_g G1) G2                             output gate
    kk          = normalize(k * k_k) per head                    the key the state is corrected along
    k           = k * (1 + (lr - 1) * k_a)
    v           = lerp(v, v_first, sigmoid(v0 + x_v V1 V2))      value residual to the first layer's v (not on it)
    S_t         = (diag(e^w_t) - kk_t (kk_t * lr_t)^T) S_{t-1} + k_t v_t^T,  o_t = S_t^T r_t
                  = generalized_delta_rule(r, k, v, w, a=-kk, b=kk * lr, scale=1)
    o           = groupnorm_per_head(o) + (sum_K r * k * r_k) v  the "bonus": the current token's own k v^T
    y           = W_o (o * g)

The decay: BlinkDL's CUDA kernel takes w' = -softplus(-(w0 + ...)) - 0.5 and decays by exp(-exp(w')); its
CPU path and fla take exp(-e^{-1/2} sigmoid(w0 + ...)). The two are one number, since exp(-softplus(-z)) =
sigmoid(z): the log-decay the op wants is -exp(w'), not w' itself.

The value residual crosses layers: the first RWKV-7 layer of a forward stores its v in ``carry["v_first"]``
(the dict the model passes to every layer of one forward, ``subquad.layers.base``), and every later one
reads it. A layer run alone (``carry`` None) is a first layer; its ``v_lora`` exists (checkpoints hold
it in every layer) and is unused. Parameter names follow fla's ``RWKV7Attention`` (the ``*_lora`` are
``Sequential(down, activation, up)``); the checkpoint formats map BlinkDL's w0/w1/w2 etc. onto them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.shift import token_shift
from subquad.ops import generalized_delta_rule
from subquad.ops.common.checks import state_dtype

DECAY = math.exp(-0.5)        # the log-decay's floor: w in (-e^{-1/2}, 0), so a step keeps at least 54.5%
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def default_ranks(d_model: int, head_dim: int) -> dict:
    """fla's LoRA widths: c * sqrt(D) rounded to a multiple of 32, at least 32, the decay's and lr's widened
    by head_dim / 64."""
    def rank(c, factor):
        return max(32, int(round(c * d_model ** 0.5 * factor / 32) * 32))

    f = head_dim / 64
    return {"decay_rank": rank(2.5, f), "a_rank": rank(2.5, f), "v_rank": rank(1.7, f), "gate_rank": rank(5.0, 1.0)}


def _lora(d_model: int, rank: int, activation: nn.Module, bias: bool = True) -> nn.Sequential:
    """x -> up(activation(down(x))): a low-rank projection D -> rank -> D. The model's generic
    re-initialisation leaves it alone (``keep_init``): ``RWKV7._reset`` sets it."""
    lora = nn.Sequential(nn.Linear(d_model, rank, bias=False), activation, nn.Linear(rank, d_model, bias=bias))
    lora[0].keep_init = lora[2].keep_init = True
    return lora


class RWKV7(Mixer):
    """RWKV-7's time mix (module docstring): S_t = (diag(e^w_t) - kk_t (kk_t lr_t)^T) S_{t-1} + k_t v_t^T.

    Args: d_model; n_heads H (head_dim K = d_model / H; checkpoints use K = 64); decay_rank, a_rank, v_rank,
    gate_rank (the low-rank widths of w, lr, the value residual and g; None: fla's defaults from d_model);
    norm_eps (the per-head GroupNorm's epsilon; BlinkDL's 64e-5 = head_dim x 1e-5); mode; chunk_size.
    State: {"S": (B, H, K, K) float32 (float64 for float64), "shift": (B, 1, d_model) the last input}.
    """
    normed_output = True
    uses_carry = True       # the value residual (module docstring); whole forwards, no pieces (Mixer.forward)
    unused_parameters = True  # the first layer's v_lora has no gradient (train.parallelize tells DDP)

    def __init__(self, d_model: int, n_heads: int = 4, decay_rank: int | None = None, a_rank: int | None = None,
                 v_rank: int | None = None, gate_rank: int | None = None, norm_eps: float = 64e-5,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        if n_heads <= 0 or d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must be positive and divide d_model={d_model}")
        for name, r in (("decay_rank", decay_rank), ("a_rank", a_rank), ("v_rank", v_rank), ("gate_rank", gate_rank)):
            if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r <= 0):
                raise ValueError(f"{name} must be a positive int or None (fla's default), got {r!r}")
        if not (isinstance(norm_eps, (int, float)) and norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")
        D, self.n_heads = d_model, n_heads
        self.head_dim = K = D // n_heads
        ranks = default_ranks(D, K)
        self.decay_rank, self.a_rank = decay_rank or ranks["decay_rank"], a_rank or ranks["a_rank"]
        self.v_rank, self.gate_rank = v_rank or ranks["v_rank"], gate_rank or ranks["gate_rank"]
        self.norm_eps = norm_eps
        for name in MIXES:
            setattr(self, name, nn.Parameter(torch.zeros(D)))
        self.k_k, self.k_a = nn.Parameter(torch.zeros(D)), nn.Parameter(torch.zeros(D))
        self.r_k = nn.Parameter(torch.zeros(n_heads, K))
        self.r_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.w_lora = _lora(D, self.decay_rank, nn.Tanh())
        self.a_lora = _lora(D, self.a_rank, nn.Identity())
        self.v_lora = _lora(D, self.v_rank, nn.Identity())
        self.g_lora = _lora(D, self.gate_rank, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(n_heads, D, eps=norm_eps)
        self._reset(0, 2)

    def place(self, layer: int, n_layers: int) -> None:
        """The depth-dependent initialisation of layer ``layer`` of ``n_layers`` (the model calls it)."""
        self._reset(layer, n_layers)

    @torch.no_grad()
    def _reset(self, layer: int, n_layers: int) -> None:
        """RWKV-LM's initialisation (as fla's ``RWKV7Attention._initialize_weights``) for the parameters the
        model's generic one does not cover: token-shift mixes, the LoRAs and their biases, k_k, k_a, r_k and
        the norm's weight. The projections r, k, v, o take the model's."""
        D, K = self.d_model, self.head_dim
        deep = layer / max(n_layers - 1, 1)                  # 0 at the first layer, 1 at the last
        shallow = 1.0 - layer / n_layers                      # 1 at the first layer, ~0 at the last
        n = torch.arange(D, dtype=torch.float32)
        ddd = n / D
        linear = n / max(D - 1, 1) - 0.5
        zigzag = ((n % K) - (K - 1) / 2) / max((K - 1) / 2, 1)
        zigzag = zigzag * zigzag.abs()
        www = -6 + 6 * (n / max(D - 1, 1)) ** (1 + deep ** 0.3)
        for name, p in zip(MIXES, (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)):
            getattr(self, name).copy_(1.0 - ddd ** (p * shallow))
        self.k_k.copy_(0.71 - linear * 0.1)
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        for lora, bias in ((self.w_lora, www + 0.5 + zigzag * 2.5), (self.a_lora, -0.19 + zigzag * 0.3 + linear * 0.4),
                           (self.v_lora, 0.73 - linear * 0.4), (self.g_lora, None)):
            lora[0].weight.zero_()
            lora[2].weight.normal_(0, 0.1 / lora[2].weight.shape[1] ** 0.5)
            if bias is not None:
                lora[2].bias.copy_(bias)
        self.g_norm.weight.fill_(((layer + 1) / n_layers) ** 0.7)
        self.g_norm.bias.zero_()

    def mix_flops(self, T):
        """Per head K x V: the decay, a^T S and its rank-one correction, the write k v^T, the read r S; the
        four LoRAs are Linears (counted with the projections)."""
        return 9.0 * self.n_heads * self.head_dim * self.head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype),
                "shift": torch.zeros(batch_size, 1, self.d_model, device=device, dtype=dtype)}

    def mix(self, x, state, seq, carry=None):
        B, T, D = x.shape
        H, K = self.n_heads, self.head_dim
        prev, shift = seq.causal_conv(token_shift, x, 1, None if state is None else state["shift"])
        dx = prev - x
        xr, xw, xk, xv, xa, xg = (torch.addcmul(x, dx, getattr(self, name)) for name in MIXES)
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = -DECAY * torch.sigmoid(self.w_lora(xw).to(state_dtype(x.dtype)))      # log-decay, float32 or 64
        lr = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.k_k).view(B, T, H, K), dim=-1)
        k = k * (1 + (lr - 1) * self.k_a)
        if carry is not None and "v_first" in carry:                                 # a later layer
            v = torch.lerp(v, carry["v_first"].to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        elif carry is not None:                                                      # the first layer
            carry["v_first"] = v
        r, k, v, lr, w = (t.reshape(B, T, H, K) for t in (r, k, v, lr, w))
        o, S = seq.recurrence(generalized_delta_rule, r, k, v, w, -kk, kk * lr, scale=1.0, mode=self.mode,
                              chunk_size=self.chunk_size, initial_state=None if state is None else state["S"])
        n = self.g_norm
        o = F.group_norm(o.reshape(B * T, D), H, n.weight, n.bias, n.eps).view(B, T, D)
        o = o + ((r * k * self.r_k).sum(-1, keepdim=True) * v).view(B, T, D)       # the bonus
        return self.o_proj(o * g), {"S": S, "shift": shift}
