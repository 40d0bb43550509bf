"""Feature maps phi for linear attention: phi(q) . phi(k) stands in for exp(q . k / sqrt(d)).

    elu+1      phi(x) = elu(x) + 1                                 Katharopoulos et al. 2020
    relu       phi(x) = max(x, 0)
    performer  phi(x) = exp(W x' - |x'|^2 / 2 - c) / sqrt(m),      FAVOR+, Choromanski et al. 2021
               x' = x d^-1/4, W (m, d) positive orthogonal random features
    taylor     phi(x) = [1, x' , vec(x' x'^T) / sqrt(2)],  x' = x d^-1/4      Based, Arora et al. 2024
               so phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d)
    identity   phi(x) = x (for testing the ops on raw inputs)

Every map acts on the last dimension only, token by token: no statistic is ever
taken over other tokens, so causal outputs never see the future. Performer's
stabiliser c is the query's own max over its features (a per-query factor that
cancels exactly in normalised attention) and 0 for keys, whose exponent is
clamped at 60 instead (reached only when |w_i|^2 / 2 > 60, i.e. never for
head dims <= 64) - unlike reference code that subtracts a max over all keys of
the sequence, which leaks the future into causal outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad.ops.common.checks import state_dtype

_KEY_EXP_CLAMP = 60.0


class FeatureMap(nn.Module):
    """Base: ``forward(x, is_query=False)`` maps (..., d) to (..., out_dim(d))."""

    name = "base"

    def out_dim(self, d: int) -> int:
        return d

    def flops(self, d: int) -> float:
        """FLOPs of mapping one (d,) vector, counting multiply-adds as elsewhere (elementwise work is not
        counted, as no layer counts its activations)."""
        return 0.0


class EluPlusOne(FeatureMap):
    name = "elu+1"

    def forward(self, x, is_query: bool = False):
        return F.elu(x) + 1


class ReLU(FeatureMap):
    name = "relu"

    def forward(self, x, is_query: bool = False):
        return F.relu(x)


class Identity(FeatureMap):
    name = "identity"

    def forward(self, x, is_query: bool = False):
        return x


class Taylor(FeatureMap):
    """Second-order Taylor expansion of exp (Based): feature dim 1 + d + d^2."""

    name = "taylor"

    def out_dim(self, d: int) -> int:
        return 1 + d + d * d

    def forward(self, x, is_query: bool = False):
        d = x.shape[-1]
        x = x * d ** -0.25
        x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)   # (..., d*d)
        return torch.cat([torch.ones_like(x[..., :1]), x, x2], dim=-1)


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """(m, d) rows orthogonal in blocks of d, each row rescaled to a chi(d)-distributed norm."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64, device=generator.device)
        qmat, _ = torch.linalg.qr(g)
        blocks.append(qmat.T)
    w = torch.cat(blocks, dim=0)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64, device=generator.device).norm(dim=-1, keepdim=True)
    return w * norms


class Performer(FeatureMap):
    """FAVOR+ positive orthogonal random features (m features for head dim d)."""

    name = "performer"

    def __init__(self, head_dim: int, num_features: int = 256, seed: int = 0):
        super().__init__()
        if head_dim is None or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int for the performer map, got {head_dim!r}")
        if num_features <= 0:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        self.head_dim, self.num_features, self.seed = head_dim, num_features, seed
        self.register_buffer("weight", torch.empty(num_features, head_dim), persistent=True)
        self.redraw(seed)

    def redraw(self, seed: int | None = None) -> None:
        """Draw a fresh projection (a new seed each call unless one is given)."""
        self.seed = self.seed + 1 if seed is None else seed
        g = torch.Generator().manual_seed(self.seed)
        w = orthogonal_gaussian(self.num_features, self.head_dim, g)
        with torch.no_grad():
            self.weight.copy_(w.to(self.weight.dtype))

    def out_dim(self, d: int) -> int:
        return self.num_features

    def flops(self, d: int) -> float:
        """The projection x W^T onto the m random features."""
        return 2.0 * d * self.num_features

    def forward(self, x, is_query: bool = False):
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x's last dim must be head_dim={self.head_dim}, got shape {tuple(x.shape)}")
        dt = state_dtype(x.dtype)
        x = x.to(dt) * self.head_dim ** -0.25
        proj = x @ self.weight.to(dt).T                                        # (..., m)
        expo = proj - 0.5 * (x * x).sum(-1, keepdim=True)
        if is_query:
            expo = expo - expo.amax(-1, keepdim=True).detach()                 # own features only
        else:
            expo = expo.clamp(max=_KEY_EXP_CLAMP)
        return torch.exp(expo) / math.sqrt(self.num_features)


FEATURE_MAPS = {
    "elu+1": EluPlusOne,
    "relu": ReLU,
    "performer": Performer,
    "taylor": Taylor,
    "identity": Identity,
}


def feature_map(name: str, head_dim: int | None = None, **kwargs) -> FeatureMap:
    """Build a feature map by name: one of ``FEATURE_MAPS``.

    >>> phi = feature_map("performer", head_dim=32, num_features=128)
    >>> phi(torch.randn(2, 10, 4, 32), is_query=True).shape
    torch.Size([2, 10, 4, 128])
    """
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature map must be one of {sorted(FEATURE_MAPS)}, got {name!r}")
    cls = FEATURE_MAPS[name]
    if cls is Performer:
        return cls(head_dim, **kwargs)
    if kwargs:
        raise ValueError(f"feature map {name!r} takes no options, got {sorted(kwargs)}")
    return cls()
