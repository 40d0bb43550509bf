"""Hyper-connections and per-layer n-gram embeddings (Qwen4-Exp): ``ModelConfig.hyper``.

The residual stream is n streams of d_model, h (B, T, n d): the embedding repeated n times. Each branch (the
mixer, the MLP) reads one mix of the streams and writes into every stream with its own weight
(``HyperConnection``, the layer's ``norm1`` / ``norm2``):

    hn = rmsnorm_d(h) * w                       (B, T, n d)    RMS over each stream's d dims
    a  = sigmoid(W_up silu(W_down hn / n))      (B, T, n d)    W_down: n d -> rank, W_up: rank -> n d
    x  = mean_i (a * hn)_i                      (B, T, d)      the branch's input
    g  = 2 sigmoid(W_inj hn / n)                (B, T, n)      W_inj: n d -> n
    h  = h + g_i * branch(x)   for each stream i

The model's final norm is one more ``HyperConnection`` without W_inj: x (B, T, d) goes to the head.

Per-layer embeddings (PLE, ``hyper["ple"]``) at the layers it lists, before the mixer's hyper-connection:

    t~_s(p)  = eos if p - s < 0 or an eos lies in [p - s, p - 1], else t_{p-s}     (documents end at eos)
    id_m     = xor_{s < m} (t~_s * mult_s)                  for the m-grams, m = 2 .. N (int64, wrapping)
    e        = concat over m, heads j of m: E[id_m mod size_{m,j} + offset_{m,j}]    (B, T, P)
    k        = rmsnorm_d(W_k e) (B, T, n, d);  v = W_v e (B, T, d);  q = rmsnorm_d(h) (B, T, n, d)
    g        = k . q / sqrt(d);  g = sign(g) sqrt(max(|g|, 1e-6))                 (B, T, n, 1)
    u        = sigmoid(g) v                                  (B, T, n d)
    h        = h + u + silu(conv_{K, dilation N}(rmsnorm_d(u)))    (a causal depthwise conv over time)

The hash constants (a prime table size per head from ``vocab_base`` on, the odd multipliers from ``seed``)
are computed as transformers computes them and kept as buffers. The layer's decoding state adds "ple.ctx"
(B, N - 1): the last N - 1 tokens, and "ple.conv" (B, n d, (K - 1) N): the convolution's inputs' tail.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers import sequence

TOKENS = "tokens"            # the carry entry PLE reads: the forward's token ids (B, T)
PLE_STATE = "ple."           # a PLE layer's entries in its block's state
PLE_DEFAULTS = {"ngram": 3, "heads_per_ngram": 8, "conv_size": 4, "vocab_base": 20_000_000, "vocab_multiple": 128,
                "seed": 1234, "parts": 1}


def check_hyper(h, n_layers: int, vocab_size: int) -> dict:
    """``ModelConfig.hyper`` with defaults filled in: {"streams": n >= 2, "rank": r, "ple": None or {"layers": [..],
    "dim": P, "eos": id, PLE_DEFAULTS' keys}}; ValueError naming the key otherwise."""
    if not isinstance(h, dict) or set(h) - {"streams", "rank", "ple"}:
        raise ValueError(f"hyper must be a dict with streams, rank and ple, got {h!r}")
    for key, low in (("streams", 2), ("rank", 1)):
        v = h.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"hyper['{key}'] must be an int >= {low}, got {v!r}")
    p = h.get("ple")
    if p is not None:
        unknown = set(p) - set(PLE_DEFAULTS) - {"layers", "dim", "eos"}
        if unknown:
            raise ValueError(f"unknown hyper['ple'] keys {sorted(unknown)}")
        p = {**PLE_DEFAULTS, **p}
        for key in ("dim", "eos", *PLE_DEFAULTS):
            if isinstance(p.get(key), bool) or not isinstance(p.get(key), int) or p[key] < (0 if key == "eos" else 1):
                raise ValueError(f"hyper['ple']['{key}'] must be a positive int, got {p.get(key)!r}")
        heads = (p["ngram"] - 1) * p["heads_per_ngram"]
        if p["ngram"] < 2 or p["dim"] % heads:
            raise ValueError(f"hyper['ple']: dim={p['dim']} must divide by (ngram - 1) x heads_per_ngram = {heads}")
        if p["eos"] >= vocab_size:
            raise ValueError(f"hyper['ple']['eos']={p['eos']} must be a token id below vocab_size={vocab_size}")
        if not isinstance(p.get("layers"), (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in p["layers"]):
            raise ValueError(f"hyper['ple']['layers'] must list layer indices in [0, {n_layers}), "
                             f"got {p.get('layers')!r}")
        p["layers"] = sorted(set(p["layers"]))
    return {"streams": h["streams"], "rank": h["rank"], "ple": p}


class GroupRMSNorm(nn.Module):
    """x / rms(x) over each group of ``group`` dims, times ``weight`` (n group,)."""

    def __init__(self, dim: int, group: int, eps: float = 1e-6):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        g = xf.unflatten(-1, (-1, self.group))
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2).to(x.dtype) * self.weight


class HyperConnection(nn.Module):
    """h (B, T, n d) -> (x (B, T, d), g (B, T, n)) (module doc); without ``inject`` (the model's last), x alone."""

    def __init__(self, d: int, n: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.d, self.n = d, n
        self.norm = GroupRMSNorm(n * d, d, eps)
        self.down = nn.Linear(n * d, rank, bias=False)
        self.up = nn.Linear(rank, n * d, bias=False)
        self.inject = nn.Linear(n * d, n, bias=False) if inject else None

    def forward(self, h):
        hn = self.norm(h)
        a = torch.sigmoid(self.up(F.silu(self.down(hn) / self.n)))
        x = (a * hn).unflatten(-1, (self.n, self.d)).mean(-2)
        if self.inject is None:
            return x
        return x, 2 * torch.sigmoid(self.inject(hn) / self.n)


def _splitmix64(v: int) -> int:
    m = (1 << 64) - 1
    v = (v + 0x9E3779B97F4A7C15) & m
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & m
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & m
    return (v ^ (v >> 31)) & m


def ngram_multipliers(vocab_size: int, ngram: int, index: int, seed: int) -> list[int]:
    """The odd multipliers of PLE layer ``index`` (the index among PLE layers), each < 2^63 / vocab_size."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * index
    return [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) % half) + 1
            for i in range(ngram)]


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % f for f in range(3, math.isqrt(v) + 1, 2))


@functools.lru_cache(maxsize=None)
def primes_from(start: int, count: int) -> tuple:
    """The first ``count`` primes >= start (trial division: the table sizes, ~2e7, take microseconds each)."""
    out, v = [], start
    while len(out) < count:
        if _is_prime(v):
            out.append(v)
        v += 1
    return tuple(out)


class PLE(nn.Module):
    """Per-layer hashed n-gram embeddings into every stream (module doc); ``index``: this layer's among the PLE
    layers (it picks the hash multipliers and table sizes)."""

    def __init__(self, d: int, n: int, eps: float, vocab_size: int, p: dict, index: int):
        super().__init__()
        self.d, self.n, self.eos, self.N = d, n, p["eos"], p["ngram"]
        self.hpn = p["heads_per_ngram"]
        heads = (self.N - 1) * self.hpn
        sizes = primes_from(p["vocab_base"], (index + 1) * heads)[index * heads:]
        offsets = [sum(sizes[:j]) for j in range(heads)]
        rows = -(-sum(sizes) // p["vocab_multiple"]) * p["vocab_multiple"]
        self.register_buffer("multipliers", torch.tensor(ngram_multipliers(vocab_size, self.N, index, p["seed"])))
        self.register_buffer("head_sizes", torch.tensor(sizes, dtype=torch.long))
        self.register_buffer("head_offsets", torch.tensor(offsets, dtype=torch.long))
        self.table = nn.Embedding(rows, p["dim"] // heads)
        self.key_proj = nn.Linear(p["dim"], n * d, bias=False)
        self.value_proj = nn.Linear(p["dim"], d, bias=False)
        self.norm_key, self.norm_query, self.norm_conv = (GroupRMSNorm(n * d, d, eps) for _ in range(3))
        self.conv1d = nn.Conv1d(n * d, n * d, p["conv_size"], groups=n * d, dilation=self.N, bias=False)
        self.reach = (p["conv_size"] - 1) * self.N

    def empty_state(self, batch_size, device=None, dtype=torch.float32) -> dict:
        return {"ctx": torch.full((batch_size, self.N - 1), self.eos, dtype=torch.long, device=device),
                "conv": torch.zeros(batch_size, self.n * self.d, self.reach, dtype=dtype, device=device)}

    def ngram_ids(self, hist):
        """hist (B, S) tokens -> (B, S, heads) rows of the table (module doc: t~_s, id_m)."""
        B, S = hist.shape
        pos = torch.arange(S, device=hist.device)
        last_eos = torch.where(hist == self.eos, pos, -1).cummax(1).values       # the latest eos at or before p
        before = F.pad(last_eos[:, :-1], (1, 0), value=-1)                         # ... strictly before p
        mixed, out = None, []
        for s in range(self.N):
            src = hist.gather(1, (pos - s).clamp_min(0).expand(B, S))
            ok = (pos - s >= 0) & (before < pos - s) if s else torch.ones_like(hist, dtype=torch.bool)
            t = torch.where(ok, src, torch.full_like(hist, self.eos)) * self.multipliers[s]
            mixed = t if mixed is None else mixed ^ t
            if s:
                j = slice((s - 1) * self.hpn, s * self.hpn)
                out.append(torch.remainder(mixed[..., None], self.head_sizes[j]) + self.head_offsets[j])
        return torch.cat(out, -1)

    def _one(self, h, tokens, ctx, tail):
        c = self.N - 1
        hist = torch.cat([ctx, tokens.long()], 1)
        e = self.table(self.ngram_ids(hist)[:, c:]).flatten(-2)                    # (B, T, P)
        k = self.norm_key(self.key_proj(e)).unflatten(-1, (self.n, self.d))
        q = self.norm_query(h).unflatten(-1, (self.n, self.d))
        g = (k * q).sum(-1, keepdim=True) / math.sqrt(self.d)
        g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        u = (torch.sigmoid(g) * self.value_proj(e)[..., None, :]).flatten(-2)     # (B, T, n d)
        full = torch.cat([tail.to(u.dtype), self.norm_conv(u).transpose(1, 2)], -1)   # (B, n d, reach + T)
        y = F.conv1d(full, self.conv1d.weight, groups=self.n * self.d, dilation=self.N).transpose(1, 2)
        tail = full[..., full.shape[-1] - self.reach:]
        return u + F.silu(y), {"ctx": hist[:, -c:], "conv": tail}

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        """h (B, T, n d), the PLE state {"ctx", "conv"} or None, packed sequences' ``cu_seqlens`` (h is one row),
        the carry holding the tokens (B, T) -> (what adds to h, the new state, a row per sequence): a mixer's
        contract, which speculative decoding's replay calls (``Block.state_parts``)."""
        if not carry or TOKENS not in carry:
            raise ValueError(f"a PLE layer reads the token ids (carry[{TOKENS!r}]); it runs inside a LanguageModel")
        if not sequence.backend().whole_sequence:
            raise ValueError("PLE's n-grams and convolution read the tokens before each one: it runs no shard of a "
                             "sequence (context parallelism)")
        tokens = carry[TOKENS]
        lengths = None if cu_seqlens is None else torch.as_tensor(cu_seqlens).diff().tolist()
        rows = h.shape[0] if lengths is None else len(lengths)
        if state is None:
            state = self.empty_state(rows, h.device, h.dtype)
        ctx, tail = state["ctx"], state["conv"]
        if lengths is None:
            return self._one(h, tokens, ctx, tail)
        outs = [self._one(hi, ti, ctx[i:i + 1], tail[i:i + 1])
                for i, (hi, ti) in enumerate(zip(h.split(lengths, 1), tokens.split(lengths, 1)))]
        return torch.cat([y for y, _ in outs], 1), {k: torch.cat([s[k] for _, s in outs], 0) for k in outs[0][1]}
