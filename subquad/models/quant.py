"""Quantised weights for inference: int8 (per output channel) and bfloat16 projections.

    quantize(model, "int8")      every projection W (N, K) -> q (N, K) int8 and s (N,) float32,
                                 W ~ s[:, None] * q,  s = max_k |W[n, k]| / 127  (symmetric, per channel)
    quantize(model, "bf16")      every projection stored in bfloat16
    y = Linear(x) computed as:   decoding (rows <= DECODE_ROWS): fbgemm's int8 matrix product
                                 (torch.ops.quantized.linear_dynamic: x quantised to 8 bits per call,
                                 int32 accumulation, * s) - it reads one byte per weight;
                                 prefill (more rows): x (s[:, None] q)^T in x's dtype - weight-only
    bf16:                        (x.bfloat16() W^T).to(x.dtype)

What is quantised, as llama.cpp's Q8_0 does: the projections of every mixer and MLP, the experts (one
``Int8Linear`` per expert), the routers and the vocabulary head (a tied head gets its own quantised copy;
the embedding lookup stays full precision). What stays in full precision: the SSM parameters (A_log, D,
dt_bias), the short convolutions, the norms and every 1-D tensor; the recurrent state stays float32.

Why fbgemm: on one row it reads int8 weights near the memory bandwidth and keeps most of that rate at 8 rows,
where ``aten._weight_int8pack_mm`` (the weight-only kernel torchao's int8 path calls on CPU) is an order of
magnitude slower with float32 activations and falls away with more rows, and inductor's fused
dequantise-and-reduce is slower too. torch has deprecated its quantised tensors (this kernel's packing
takes one); where ``torch.ops.quantized.linear_dynamic`` is gone, every product takes the dequantising path.
Activations keep 8 bits on CPUs with VNNI, 7 elsewhere (``_has_vnni``). Its activation scale is one per
call, so at batch > 1 rows share it: a quantised batch equals its rows run alone within the quantisation
error, not bit for bit (float weights are exact). The kernel is wrapped as the custom op
``subquad::int8_linear`` so a compiled decode step (``models.decode``) keeps it in its graph.

A quantised model is for inference: it refuses to train (no gradient reaches int8 weights) and to be
saved (save the float checkpoint it came from).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZE = ("int8", "bf16")
DECODE_ROWS = 16            # at most this many rows take fbgemm's kernel; more (prefill) dequantise
MIN_WEIGHTS = 1 << 18       # smaller matrices stay float32: fbgemm's fixed cost per call exceeds the time the
                            # bytes it saves would take (mamba-130m's x_proj and dt_proj: 123K and 74K weights)

_keys = itertools.count()
_PACKED: dict[int, tuple] = {}   # key -> (q's data_ptr, q's version, fbgemm's packed weight)


def _has_vnni() -> bool:
    """Whether this CPU multiplies 8-bit integers with 32-bit accumulation (AVX512-VNNI / AVX-VNNI). Without
    it fbgemm sums pairs of products in 16 bits, which can saturate, so activations keep 7 bits there
    (``reduce_range``); with it they keep all 8 (mamba2's int8 logits: 5% of their scale off with 7 bits,
    under 3% with 8, tests/models/test_quant.py)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_vnni" in flags or " avx_vnni" in flags


REDUCE_RANGE = not _has_vnni()
FBGEMM = hasattr(torch.ops.quantized, "linear_dynamic")   # deprecated in torch; without it, prefill's path


def _packed(q: torch.Tensor, scale: torch.Tensor, key: int):
    """fbgemm's packed form of q with per-channel scales, made once per (tensor, version) of q."""
    hit = _PACKED.get(key)
    if hit is not None and hit[0] == q.data_ptr() and hit[1] == q._version:
        return hit[2]
    with warnings.catch_warnings():          # torch deprecates quantised tensors; the kernel is still the fastest
        warnings.simplefilter("ignore")
        qt = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(qt, None)
    _PACKED[key] = (q.data_ptr(), q._version, packed)
    return packed


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                key: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, q (N, K) int8, scale (N,) float32, bias (N,) or None, key a 0-d int64 tensor naming
    the packed weight -> (..., N) in x's dtype (module doc). Kept lean: it runs ~100 times per token."""
    if FBGEMM and x.numel() <= DECODE_ROWS * x.shape[-1] and x.device.type == "cpu":
        x2 = x if x.dim() == 2 and x.dtype == torch.float32 else x.reshape(-1, x.shape[-1]).float()
        y = torch.ops.quantized.linear_dynamic(x2, _packed(q, scale, key.item()), REDUCE_RANGE)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)
    y = F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], None if bias is None else bias.to(x.dtype))
    return y


# The op torch.compile keeps in its graph. Registered with torch.library's low-level API, whose dispatch costs
# a fraction of the custom_op decorator's wrapper - paid on every projection of every decoded token.
_LIB = torch.library.Library("subquad", "DEF")
_LIB.define("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, Tensor key) -> Tensor")
_LIB.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("subquad::int8_linear")
def _(x, q, scale, bias, key):
    return x.new_empty(*x.shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 per output channel (module doc): ``q`` (N, K) int8, ``scale`` (N,)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a (out, in) weight, got shape {tuple(weight.shape)}")
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        key = next(_keys)
        self.register_buffer("key", torch.tensor(key), persistent=False)
        weakref.finalize(self, _PACKED.pop, key, None)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight s[:, None] q (float32): what the products compute with."""
        return self.q.float() * self.scale[:, None]

    def forward(self, x):
        return torch.ops.subquad.int8_linear(x, self.q, self.scale, self.bias, self.key)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Bf16Linear(nn.Module):
    """A Linear whose weight is stored in bfloat16; x is cast to bfloat16 for the product, y back to x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("w", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.w.float()

    def forward(self, x):
        return F.linear(x.to(torch.bfloat16), self.w, self.bias).to(x.dtype)


def quantized_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    return (Int8Linear if kind == "int8" else Bf16Linear)(weight, bias)


def quantize(model, kind: str, min_weights: int = MIN_WEIGHTS):
    """Quantise ``model`` (a ``LanguageModel``) in place for inference (module doc) and return it.

    Every ``nn.Linear`` of at least ``min_weights`` weights (``MIN_WEIGHTS``; 0: all) (but those a layer reads as a matrix, listed in its ``keep_float``: MLA's absorbed
    ``kv_b_proj``) becomes an ``Int8Linear`` / ``Bf16Linear`` (the output of a 1-output gate too), every
    mixture-of-experts layer gets one per expert and projection, and the vocabulary head (tied or not) one
    of its own. Refused: an unknown kind, a model that is not float32 (quantise from float32 weights), a model
    already quantised."""
    from subquad.models.moe import MoE

    if kind not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {kind!r}")
    if getattr(model, "quantized", None):
        raise ValueError(f"the model is already quantised ({model.quantized})")
    dtype = model.embed.weight.dtype
    if dtype != torch.float32:
        raise ValueError(f"quantize needs a float32 model (it keeps the rest in float32), got {dtype}; load it "
                         f"with dtype=float32")
    model.eval()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name not in getattr(module, "keep_float", ()) and \
                    child.weight.numel() >= min_weights:
                setattr(module, name, quantized_linear(kind, child.weight, child.bias))
        if isinstance(module, MoE) and module.w_up[0].numel() >= min_weights:
            module.quantize_experts(lambda w: quantized_linear(kind, w))
    head = model.embed.weight if model.head is None else model.head.weight
    model.head = quantized_linear(kind, head)            # a tied head keeps the embedding for the lookup
    model.quantized = kind
    for p in model.parameters():
        p.requires_grad_(False)
    return model
