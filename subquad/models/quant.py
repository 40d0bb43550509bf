"""Quantised weights for inference: int8 (per output channel), int4 (per group of inputs) and bfloat16 projections.

    quantize(model, "int8")      every projection W (N, K) -> q (N, K) int8 and s (N,) float32,
                                 W ~ s[:, None] * q,  s = max_k |W[n, k]| / 127  (symmetric, per channel)
    quantize(model, "int4")      every projection W (N, K) -> codes c (N, K) in [0, 15] and, per group of g input
                                 channels (``group_size``, default 128), a bfloat16 scale s and zero z:
                                 W ~ (c - 8) s + z,  s = (max - min) / 15,  z = min + 8 s  (asymmetric)
    quantize(model, "bf16")      every projection stored in bfloat16
    y = Linear(x) computed as:   int8, float32 rows at any count - a step's, a decoding batch's, a prompt's - on
                                 a CPU with AMX tiles (Sapphire Rapids on) or AVX-512 VNNI (Zen 4, Ice Lake;
                                 ``qgemv.packed_int8``; a width that is not a multiple of 64 padded with zeros):
                                 ``kernels.qgemv.int8_amx``, each row of x rounded to int8 with a scale of its
                                 own, exact integer sums, 16 rows against 16 channels per instruction (tiles)
                                 or 16 rows a pass over 16 channels (vectors) - in place of fbgemm's kernel
                                 below (1.2-1.6x faster) and of the prompt's exact product (AMX 4-5x, Zen 4's
                                 vectors ~2x a 2,048-token int8 prefill; the rounding roughly doubles a
                                 prefill's error against the float model, a few % on tiny random models; a
                                 row's result does not depend on the rows beside it, so a packed or chunked
                                 prompt equals the same prompt alone, and one row is as many rows are: a
                                 served stream equals ``generate`` alone; ``SUBQUAD_AMX=0``: neither);
                                 int8 without them, at most
                                 ``qgemv.INT8Q_ROWS`` float32 rows of a width that is a multiple of 32: a C
                                 kernel (``kernels.qgemv.int8q_gemv``: x rounded to int8 per block of 32
                                 inputs with a float scale, as llama.cpp's Q8_0 products do; exact integer
                                 sums) - it reads the weights near the memory's rate (fbgemm's kernel, one x
                                 scale per call, is faster from 4 rows; benchmarks/RESULTS.md) - then a row's
                                 result depends on the rows beside it (1-2 rows round per block, more per call);
                                 int8 decoding (rows <= DECODE_ROWS, or any rows inside ``mode.decoding()``: the
                                 steps and verifications of a batch): fbgemm's int8 matrix product
                                 (torch.ops.quantized.linear_dynamic: x quantised to 8 bits per call,
                                 int32 accumulation, * s), DECODE_ROWS rows per call - it reads one byte per
                                 weight;
                                 int4, up to ``qgemv.INT4_ROWS`` float32 rows: a C kernel
                                 (``kernels.qgemv``: x rounded to int8 per block of 32, the codes read
                                 in torch's packed layout);
                                 int8 per block (a GGUF file's), at most 8 float32 rows (16 for Q8_0's
                                 and Q4_0's blocks inside ``decoding()``, ``qgemv.ROUNDED_ROWS``): a C kernel,
                                 Q8_0's blocks of 32 with x rounded per block as llama.cpp
                                 rounds it (``qgemv.int8q_gemv``), others x exact (``int8_gemv``);
                                 int4, more rows up to this module's INT4_ROWS: torch's int4 kernel
                                 (aten._weight_int4pack_mm_for_cpu: x rounded to bfloat16, the weights
                                 dequantised in registers, float32 sums, y rounded to bfloat16) - half a byte a
                                 weight and 4 bytes a group;
                                 prefill (more rows, without the tiles): x W^T with the dequantised W in x's
                                 dtype - weight-only, exact
    bf16:                        (x.bfloat16() W^T).to(x.dtype); up to ``qgemv.BF16_ROWS`` float32 rows of a
                                 width that is a multiple of 32 where the CPU has AVX512-BF16 (Sapphire Rapids,
                                 Zen 4): ``kernels.qgemv.bf16_gemv``, the same products summed in float32 and y
                                 kept float32 (not rounded to bfloat16), from 3 rows through AMX-BF16 tiles where
                                 the CPU has them - 1.8-2.6x torch's bfloat16 product (oneDNN) at 1-16 rows

What is quantised, as llama.cpp's Q8_0 does: the projections of every mixer and MLP, the experts (one
``Int8Linear`` per expert), the routers and the vocabulary head (a tied head gets its own quantised copy;
the embedding lookup stays full precision). What stays in full precision: the SSM parameters (A_log, D,
dt_bias), the short convolutions, the norms and every 1-D tensor; the recurrent state stays float32. int4
keeps more in float32 (``INT4_FLOAT``), as GGUF's 4-bit types do: the routers and a shared expert's gate,
Mamba's x_proj and dt_proj, the delta rule's beta and decay projections - small matrices whose error a
recurrence compounds; a matrix whose input width the group size does not divide (an MLP of 680 or 1,368, the
widths ``ModelConfig.mlp_hidden`` gives models trained here) takes 8 bits per output channel instead (named in a
warning), as llama.cpp gives such tensors another type; a mixture's experts that it does not divide stay float32.

Why fbgemm: on one row it reads int8 weights near the memory bandwidth and keeps most of that rate at 8 rows,
where ``aten._weight_int8pack_mm`` (the weight-only kernel torchao's int8 path calls on CPU) is an order of
magnitude slower with float32 activations and falls away with more rows, and inductor's fused
dequantise-and-reduce is slower too. torch has deprecated its quantised tensors (this kernel's packing
takes one); where ``torch.ops.quantized.linear_dynamic`` is gone, every product takes the dequantising path.
Activations keep 8 bits on CPUs with VNNI, 7 elsewhere (``_has_vnni``). Its activation scale is one per
call, so at batch > 1 rows share it: a quantised batch equals its rows run alone within the quantisation
error, not bit for bit (float weights are exact). The kernel is wrapped as the custom op
``subquad::int8_linear`` so a compiled decode step (``models.decode``) keeps it in its graph.

Why torch's int4 kernel: it is maintained with torch (torchao's CPU int4 path calls it), packs 4-bit weights
with a bfloat16 scale and zero per group, and is vectorised on x86 (AVX512, AVX2) for bfloat16 activations
only - with float32 ones it runs a scalar loop, ~10-100x slower - so x is rounded to bfloat16 for it. Its
packed layout depends on the CPU (blocks of 64 rows on AVX512, 32 on AVX2): it is found once against torch's
own packing (``_layout``), and a saved folder holds the CPU-independent ``pair_k`` form, packed again on
loading. Without the kernel (another torch, another device) every product dequantises - the same weights,
the reference the tests hold the kernel to. Wrapped as ``subquad::int4_linear`` for the compiled step.

A quantised model is for inference: it refuses to train (no gradient reaches its weights). ``save_pretrained``
writes it as a folder of its quantised weights that ``from_pretrained`` reads back as the same model
(``hf.saver.save_quantized``, ``load_quantized``: subquad's own format; transformers does not read it).
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.kernels import qgemv
from subquad.models.mode import MODE
from subquad.heap import release_freed

QUANTIZE = ("int8", "int4", "bf16")
DECODE_ROWS = 16            # rows per call of fbgemm's kernel (they share one activation scale); a product of
                            # more rows outside ``decoding()`` (a prompt) multiplies by the dequantised weight
                            # where the AMX tiles do not take it
MIN_WEIGHTS = 1 << 18       # smaller matrices stay float32: fbgemm's fixed cost per call exceeds the time the
                            # bytes it saves would take (mamba-130m's x_proj and dt_proj: 123K and 74K weights)

_keys = itertools.count()
_PACKED: dict[int, tuple] = {}   # key -> (q's data_ptr, q's version, fbgemm's packed weight)


def _has_vnni() -> bool:
    """Whether this CPU multiplies 8-bit integers with 32-bit accumulation (AVX512-VNNI / AVX-VNNI). Without
    it fbgemm sums pairs of products in 16 bits, which can saturate, so activations keep 7 bits there
    (``reduce_range``); with it they keep all 8 (mamba2's int8 logits: 5% of their scale off with 7 bits,
    under 3% with 8, tests/models/test_quant.py)."""
    flags = kernels.cpuinfo()
    return " avx512_vnni" in flags or " avx_vnni" in flags


REDUCE_RANGE = not _has_vnni()
FBGEMM = hasattr(torch.ops.quantized, "linear_dynamic")   # deprecated in torch; without it, prefill's path


def _packed(q: torch.Tensor, scale: torch.Tensor, key: int):
    """fbgemm's packed form of q with per-channel scales, made once per (tensor, version) of q."""
    hit = _PACKED.get(key)
    if hit is not None and hit[0] == q.data_ptr() and hit[1] == kernels.version(q):
        return hit[2]
    with warnings.catch_warnings():          # torch deprecates quantised tensors; the kernel is still the fastest
        warnings.simplefilter("ignore")
        qt = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(qt, None)
    _PACKED[key] = (q.data_ptr(), kernels.version(q), packed)
    return packed


def _direct(x: torch.Tensor) -> bool:
    """Whether a quantised module may call its product's function itself rather than through its op: not while
    compiling (the graph keeps the op), nor under autocast or with x requiring grad (the op runs below both). The
    dispatcher costs ~12 us a call (AVX2 EPYC; benchmarks/RESULTS.md): a hybrid decodes through ~100 such products
    a token."""
    return not torch.compiler.is_compiling() and not x.requires_grad and not torch.is_autocast_enabled(x.device.type)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                key: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, q (N, K) int8, scale (N,) float32, bias (N,) or None, key a 0-d int64 tensor naming
    the packed weight -> (..., N) in x's dtype (module doc). Kept lean: it runs ~100 times per token."""
    # AMX tiles or VNNI's vectors at any rows, one row or a prompt's (module doc): one rounding and exact integer
    # sums whatever the rows, so a row's result does not depend on the rows beside it
    if qgemv.packed_int8() and qgemv.usable(qgemv.INT8_AMX, x, x.numel()):
        return qgemv.int8_amx(x, q, scale, bias, key.item())
    if x.shape[-1] % 32 == 0 and qgemv.usable(qgemv.INT8Q, x, qgemv.INT8Q_ROWS):   # a few rows: x to int8 per block
        return qgemv.int8q_gemv(x, q, scale, bias)
    if not FBGEMM and qgemv.usable(qgemv.INT8, x, qgemv.INT8_ROWS):     # fbgemm gone: the C kernel's rows
        return qgemv.int8_gemv(x, q, scale, None, bias)
    if FBGEMM and x.device.type == "cpu" and (x.numel() <= DECODE_ROWS * x.shape[-1]
                                              or getattr(MODE, "decoding", False)):
        x2 = x if x.dim() == 2 and x.dtype == torch.float32 else x.reshape(-1, x.shape[-1]).float()
        packed = _packed(q, scale, key.item())
        if x2.shape[0] <= DECODE_ROWS:
            y = torch.ops.quantized.linear_dynamic(x2, packed, REDUCE_RANGE)
        else:
            y = torch.cat([torch.ops.quantized.linear_dynamic(c, packed, REDUCE_RANGE)
                           for c in x2.split(DECODE_ROWS)])
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)
    y = F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], None if bias is None else bias.to(x.dtype))
    return y


# The op torch.compile keeps in its graph. Registered with torch.library's low-level API, whose dispatch costs
# a fraction of the custom_op decorator's wrapper - paid on every projection of every decoded token; eagerly the
# modules call the function itself (``_direct``).
_LIB = torch.library.Library("subquad", "DEF")
_LIB.define("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, Tensor key) -> Tensor")
_LIB.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("subquad::int8_linear")
def _(x, q, scale, bias, key):
    return x.new_empty(*x.shape[:-1], q.shape[0])


def int8_block_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K), q (N, K) int8, scale and offset (N, G) (``Int8Linear.from_blocks``) -> (..., N) in x's dtype:
    the C kernel for a few float32 rows, else x times the dequantised weight (the reference). Blocks of 32
    without offsets (GGUF's Q8_0) round those rows of x to int8 per block first, as llama.cpp's Q8_0 product
    does (``qgemv.int8q_gemv``: ~2x fewer instructions per weight than widening them); other blocks keep x."""
    if qgemv.rounds_x(q, scale, offset):                # Q8_0 / Q4_0: x rounded per block of 32, as llama.cpp's
        packed = q.dtype == torch.uint8                  # products (Q4_0's nibbles as the file packs them)
        rows = qgemv.ROUNDED_ROWS if getattr(MODE, "decoding", False) else qgemv.INT8_ROWS   # a prompt: exact
        if qgemv.usable(qgemv.Q4_0 if packed else qgemv.INT8Q, x, rows):
            return (qgemv.q4_0_gemv if packed else qgemv.int8q_gemv)(x, q, scale, bias)
    if q.dtype == torch.uint8:
        q = unpack_q4_0(q)
    if qgemv.usable(qgemv.INT8, x, qgemv.INT8_ROWS):
        return qgemv.int8_gemv(x, q, scale, offset, bias)
    return F.linear(x, dequantize_blocks(q, scale, offset, x.dtype), None if bias is None else bias.to(x.dtype))


def pack_q4_0(q: torch.Tensor) -> torch.Tensor:
    """Codes q (N, K) in [-8, 7] -> (N, K / 2) uint8 as GGUF's Q4_0 blocks hold them: per block of 32, byte j
    = (q_j + 8) | (q_{16 + j} + 8) << 4."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(q.shape[0], -1, 2, 16)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_q4_0(p: torch.Tensor) -> torch.Tensor:
    """``pack_q4_0``'s inverse: (N, K / 2) uint8 -> (N, K) int8 codes in [-8, 7]."""
    b = p.view(p.shape[0], -1, 16)
    return (torch.cat([b & 15, b >> 4], -1).to(torch.int8) - 8).reshape(p.shape[0], -1)


def dequantize_blocks(q, scale, offset, dtype) -> torch.Tensor:
    """q (N, K) int8 (or Q4_0's packed nibbles, ``unpack_q4_0``), scale and offset (N, G) -> W = q scale - offset
    per block, (N, K) in ``dtype``."""
    if q.dtype == torch.uint8:
        q = unpack_q4_0(q)
    N, K = q.shape
    G = scale.shape[1]
    w = q.view(N, G, K // G).to(dtype).mul_(scale.to(dtype)[..., None])   # in place: one (N, K) copy
    if offset is not None:
        w.sub_(offset.to(dtype)[..., None])
    return w.view(N, K)


_LIB.define("int8_block_linear(Tensor x, Tensor q, Tensor scale, Tensor? offset, Tensor? bias) -> Tensor")
_LIB.impl("int8_block_linear", int8_block_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("subquad::int8_block_linear")
def _(x, q, scale, offset, bias):
    return x.new_empty(*x.shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 per output channel (module doc): ``q`` (N, K) int8, ``scale`` (N,).

    Or per block of inputs (``from_blocks``: GGUF's block types held exactly, ``models.gguf``): ``scale`` and
    an optional ``offset`` (N, G) float32, W[n, k] = q[n, k] * scale[n, g] - offset[n, g] for k in block
    g = k // (K / G). fbgemm's kernel takes one scale per channel, so a blocked product dequantises W in x's
    dtype (the same weights, exactly as ``gguf.quants.dequantize`` computes them, in float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a (out, in) weight, got shape {tuple(weight.shape)}")
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self._init(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale, None, bias)

    def _init(self, q, scale, offset, bias):
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        key = self.key_id = next(_keys)
        self.register_buffer("key", torch.tensor(key, device="cpu"), persistent=False)
        weakref.finalize(self, _PACKED.pop, key, None)
        weakref.finalize(self, qgemv.AMX_PACKED.pop, key, None)
        self.register_load_state_dict_post_hook(kernels.loaded_in_place)     # packed copies of q made again
        self.in_features, self.out_features = q.shape[1] * (2 if q.dtype == torch.uint8 else 1), q.shape[0]

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> Int8Linear:
        """W = q * scale - offset per block (class doc): q (N, K) int8, scale and offset (N, G) float32, G
        dividing K; or GGUF's Q4_0 as it is stored - q (N, K / 2) uint8 nibbles (``pack_q4_0``), scale (N, K / 32),
        no offset: half the bytes, multiplied in C as llama.cpp does (``qgemv.q4_0_gemv``). The tensors are kept,
        not copied."""
        N, K = q.shape[0], q.shape[1] * (2 if q.dtype == torch.uint8 else 1)
        packed_ok = q.dtype != torch.uint8 or (offset is None and scale.dim() == 2 and scale.shape[1] * 32 == K)
        if q.dtype not in (torch.int8, torch.uint8) or not packed_ok or scale.dim() != 2 or scale.shape[0] != N \
                or K % scale.shape[1] or (offset is not None and offset.shape != scale.shape):
            raise ValueError(f"Int8Linear.from_blocks: q must be (N, K) int8 and scale/offset (N, G) with G dividing "
                             f"K; got q {q.dtype} {tuple(q.shape)}, scale {tuple(scale.shape)}, offset "
                             f"{None if offset is None else tuple(offset.shape)}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m._init(q, scale.float(), None if offset is None else offset.float(), bias)
        return m

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool, groups: int = 0,
              offset: bool = False, packed: bool = False) -> Int8Linear:
        """One to fill with ``load_state_dict(..., assign=True)`` (a saved int8 folder): no float weight made;
        ``groups`` > 0: blocked scales (and ``offset``), ``from_blocks``'s form (``packed``: Q4_0's nibbles)."""
        with torch.device("meta"):
            if groups:
                s = torch.empty(out_features, groups)
                q = torch.empty(out_features, in_features // 2, dtype=torch.uint8) if packed else \
                    torch.empty(out_features, in_features, dtype=torch.int8)
                m = cls.from_blocks(q, s,
                                    torch.empty_like(s) if offset else None,
                                    torch.empty(out_features) if bias else None)
            else:
                m = cls(torch.empty(out_features, in_features), torch.empty(out_features) if bias else None)
        m.key = torch.tensor(m.key_id)                   # not loaded: the name of its packed weight, on the CPU
        return m

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (float32): s[:, None] q, or per block q s - offset - what products compute with."""
        return self.dequantized(torch.float32)

    def dequantized(self, dtype) -> torch.Tensor:
        if self.scale.dim() == 1:
            return self.q.to(dtype) * self.scale.to(dtype)[:, None]
        return dequantize_blocks(self.q, self.scale, self.offset, dtype)

    def forward(self, x):
        direct = _direct(x)
        if self.scale.dim() == 2:                        # blocked: the C kernel for a few rows, else dequantised
            f = int8_block_linear if direct else torch.ops.subquad.int8_block_linear
            return f(x, self.q, self.scale, self.offset, self.bias)
        f = int8_linear if direct else torch.ops.subquad.int8_linear
        return f(x, self.q, self.scale, self.bias, self.key)

    def extra_repr(self):
        how = "per channel" if self.scale.dim() == 1 else f"per block of {self.in_features // self.scale.shape[1]}"
        how += ", 4-bit codes (Q4_0)" if self.q.dtype == torch.uint8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {how}"


class Bf16Linear(nn.Module):
    """A Linear whose weight is stored in bfloat16; x is cast to bfloat16 for the product, y back to x's dtype
    (up to ``qgemv.BF16_ROWS`` float32 rows in C where the CPU has AVX512-BF16: ``kernels.qgemv.bf16_gemv``, the
    same products summed in float32, y not rounded to bfloat16 on the way)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("w", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool) -> Bf16Linear:
        with torch.device("meta"):
            return cls(torch.empty(out_features, in_features), torch.empty(out_features) if bias else None)

    @property
    def weight(self) -> torch.Tensor:
        return self.w.float()

    def forward(self, x):
        # _direct first: inside a graph nothing of the C path is looked at (a call to the cached bf16() broke the
        # graph there, and inductor then miscompiled a Mamba-2 block's next piece: NaN logits, this Intel host)
        if _direct(x) and x.shape[-1] % 32 == 0 and qgemv.bf16() and qgemv.usable(qgemv.BF16, x, qgemv.BF16_ROWS):
            return qgemv.bf16_gemv(x, self.w, None if self.bias is None else self.bias.float())
        return F.linear(x.to(torch.bfloat16), self.w, self.bias).to(x.dtype)



class F16Linear(Bf16Linear):
    """A Linear whose weight is stored in float16 - a GGUF file's F16 matrices, kept as the file holds them
    (``models.gguf``: ``quantized`` "f16"): x stays float32 and multiplies the weights widened to float32, so the
    product is the dequantised matrix's; the bias float32. Up to ``qgemv.F16_ROWS`` rows in C
    (``kernels.qgemv.f16_gemv``: two bytes a weight read), more rows (a prompt) through the widened matrix."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.register_buffer("w", weight.detach().to(torch.float16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x):
        if _direct(x) and (lanes := qgemv.f16()) and x.shape[-1] % lanes == 0 \
                and qgemv.usable(qgemv.F16, x, qgemv.F16_ROWS):          # _direct first, as Bf16Linear's
            return qgemv.f16_gemv(x, self.w, self.bias)
        return F.linear(x, self.w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


# ---------------------------------------------------------------------------------------------------------------
# int4: 4 bits per weight, a bfloat16 scale and zero per group of ``group_size`` input channels

GROUP_SIZES = (32, 64, 128, 256)   # the group sizes torch's int4 kernel takes
GROUP_SIZE = 128                   # the default: ~as fast as 32 and 0.56 bytes a weight against 0.625
                                   # (benchmarks/RESULTS.md "int4 weights"); 32 is the more accurate
INT4_ROWS = 256                    # at most this many rows take the kernel; more (a long prefill) dequantise:
                                   # the kernel's time grows with the rows, dequantising's is mostly fixed
PACK_ROWS = 4096                   # rows packed at a time (a multiple of the layouts' blocks)
INT4_FLOAT = frozenset({"router", "shared_gate", "dt_proj", "x_proj", "a_proj", "b_proj", "f_a_proj", "f_b_proj"})
# projections int4 leaves in float32 whatever their size: a mixture's router and shared-expert gate (which
# experts run), Mamba's dt, B and C (dt_proj, x_proj), the delta rule's write strength beta (b_proj) and
# decay alpha (a_proj; KDA's f_a/f_b_proj): small matrices whose error the recurrence compounds (GGUF keeps
# them in high precision too)


def weights_name(model) -> str:
    """What a model's weights are, as a user names them: a GGUF file's own quantised types (kept as int8 blocks:
    "Q4_0 (the file's)"), the kind ``quantize`` gave it, or its parameters' dtype."""
    types = getattr(model, "gguf_types", None)
    if types:
        return f"{', '.join(types)} (the file's)"
    return getattr(model, "quantized", None) or str(next(model.parameters()).dtype).removeprefix("torch.")


def int4_quantize(w: torch.Tensor, group_size: int):
    """w (N, K) float -> (codes (N, K) uint8 in [0, 15], scale (N, K/g) bfloat16, zero (N, K/g) bfloat16) with
    W ~ (codes - 8) * scale + zero per group of g input channels (asymmetric: the grid spans the group's
    [min, max]; a constant group keeps its value up to bfloat16's rounding). The codes are rounded against
    the bfloat16 scale and zero the products use."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-30).bfloat16()
    zero = (lo + 8 * scale.float()).bfloat16()
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return codes.clamp_(0, 15).to(torch.uint8).reshape(N, K), scale, zero


def int4_dequantize(codes, scale, zero, dtype=torch.float32) -> torch.Tensor:
    """(codes - 8) * scale + zero per group: (N, K) in ``dtype`` - the weights every int4 product computes
    with (float32: one rounding, as the kernel's fused multiply-add)."""
    N, K = codes.shape
    G = scale.shape[1]
    w = (codes.view(N, G, K // G).to(dtype) - 8) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]
    return w.view(N, K)


def pair_k(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) -> (N, K/2) bytes, input channel 2j in the low nibble and 2j+1 in the high one: the
    layout a saved folder holds (the kernel's own depends on the CPU)."""
    return codes[:, 0::2] | codes[:, 1::2] << 4


def unpair_k(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([q & 15, q >> 4], -1).flatten(-2)


# torch's packed layout (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel): rows in blocks
# of ``block`` (the kernel's BLOCK_N), each block stored k-major as (K, block/2) bytes; a whole block's byte j
# holds rows j and j + block/2 on AVX512 and AVX2 ("split"), rows 2j and 2j+1 on other CPUs and in a last,
# shorter block. Which one this CPU's kernel uses is found once, against its own packing (``_layout``).
LAYOUTS = {1: (64, True), 2: (32, True), 3: (32, False)}     # 0: no kernel: the pair_k layout


def _pair_n(b, split):
    h = b.shape[-1] // 2
    return b[..., h:] << 4 | b[..., :h] if split else b[..., 1::2] << 4 | b[..., 0::2]


def _unpair_n(p, split):
    lo, hi = p & 15, p >> 4
    return torch.cat([lo, hi], -1) if split else torch.stack([lo, hi], -1).flatten(-2)


def kernel_pack(codes: torch.Tensor, layout: int) -> torch.Tensor:
    """codes (N, K) uint8, N a multiple of 16 -> (N, K/2) uint8 in the kernel's layout ``layout`` (``LAYOUTS``)."""
    block, split = LAYOUTS[layout]
    N, K = codes.shape
    full = N // block * block
    parts = [_pair_n(codes[:full].view(full // block, block, K).transpose(1, 2), split).reshape(-1)]
    if full < N:
        parts.append(_pair_n(codes[full:].T, False).reshape(-1))
    return torch.cat(parts).view(N, K // 2)


def kernel_unpack_t(packed: torch.Tensor, layout: int) -> torch.Tensor:
    """``kernel_pack``'s inverse, transposed: (N, K/2) -> codes (K, N) - the layout's own k-major order, so no
    transpose of the codes is needed (a prefill multiplies by W^T)."""
    block, split = LAYOUTS[layout]
    N, K = packed.shape[0], packed.shape[1] * 2
    full = N // block * block
    flat = packed.reshape(-1)
    body = _unpair_n(flat[:full * K // 2].view(full // block, K, block // 2), split)     # (N/block, K, block)
    body = body.transpose(0, 1).reshape(K, full)
    if full == N:
        return body
    return torch.cat([body, _unpair_n(flat[full * K // 2:].view(K, (N - full) // 2), False)], 1)


def kernel_unpack(packed: torch.Tensor, layout: int) -> torch.Tensor:
    """``kernel_pack``'s inverse: (N, K/2) -> codes (N, K)."""
    return kernel_unpack_t(packed, layout).T.contiguous()


@functools.cache
def _layout() -> int:
    """This CPU's packed layout for ``aten._weight_int4pack_mm_for_cpu``: the ``LAYOUTS`` entry whose packing
    equals torch's own and whose product is right, or 0 (no kernel: every product dequantises)."""
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if pack is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    codes = torch.randint(0, 16, (112, 64), generator=gen, dtype=torch.uint8, device="cpu")   # a block and a short one
    try:
        theirs = pack(codes.int(), 1)
    except RuntimeError:
        return 0
    for layout in LAYOUTS:
        if torch.equal(kernel_pack(codes, layout), theirs):
            scale = torch.full((112, 2), 0.5, dtype=torch.bfloat16, device="cpu")
            zero = torch.full((112, 2), 0.25, dtype=torch.bfloat16, device="cpu")
            x = torch.ones(1, 64, dtype=torch.bfloat16, device="cpu")
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, theirs, 32, _scale_zero(scale, zero, 112))
            ref = int4_dequantize(codes, scale, zero).sum(1)
            return layout if torch.equal(y.float()[0], ref) else 0
    return 0


def _scale_zero(scale, zero, rows):
    """scale, zero (N, G) -> the kernel's (G, rows, 2), rows >= N padded with zeros."""
    sz = torch.stack([scale, zero], -1).transpose(0, 1)
    return F.pad(sz, (0, 0, 0, rows - sz.shape[1])).contiguous()


def int4_linear(x: torch.Tensor, w: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None,
                out_features: int, layout: int) -> torch.Tensor:
    """x (..., K) float, w (N', K/2) uint8 codes in ``layout`` (0: ``pair_k``'s; else a ``LAYOUTS`` key, N'
    = N rounded up to 16), scale_zero (K/g, N', 2) bfloat16, bias (N,) float32 or None -> (..., N) in x's dtype.
    Up to ``qgemv.int4_rows()`` float32 rows (any with AVX-512 VNNI, a prompt's too; else 16): the C kernel (x
    rounded to int8 per block of 32). More rows up to INT4_ROWS (a CPU and torch's kernel):
    ``aten._weight_int4pack_mm_for_cpu``, whose vectorised
    form takes x rounded to bfloat16, accumulates in float32 and rounds y to bfloat16. Otherwise: x W^T with
    W = ``int4_dequantize`` in x's dtype (the reference)."""
    N, K = out_features, x.shape[-1]
    if layout and qgemv.usable(qgemv.INT4, x, qgemv.int4_rows()):   # float32 rows: the C kernel
        return qgemv.int4_gemv(x, w, scale_zero, bias, N, *LAYOUTS[layout])
    if layout and x.numel() <= INT4_ROWS * K and x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, K).bfloat16(), w, K // scale_zero.shape[0],
                                                      scale_zero)
        y = (y if y.shape[1] == N else y[:, :N]).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], N)
    if layout:           # W^T (K, N') straight from the k-major layout: the scales broadcast along k, no transpose
        G = scale_zero.shape[0]
        c = kernel_unpack_t(w, layout).view(G, K // G, -1).to(x.dtype)
        s, z = scale_zero[:, None, :, 0].to(x.dtype), scale_zero[:, None, :, 1].to(x.dtype)
        Wt = torch.addcmul(z - 8 * s, c, s).view(K, -1)            # c s + (z - 8 s): two passes over W, not four
        y = x @ Wt[:, :N]
        return y if bias is None else y + bias.to(x.dtype)
    W = int4_dequantize(unpair_k(w), scale_zero[..., 0].T, scale_zero[..., 1].T, x.dtype)
    return F.linear(x, W, None if bias is None else bias.to(x.dtype))


_LIB.define("int4_linear(Tensor x, Tensor w, Tensor scale_zero, Tensor? bias, int out_features, int layout) -> Tensor")
_LIB.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("subquad::int4_linear")
def _(x, w, scale_zero, bias, out_features, layout):
    return x.new_empty(*x.shape[:-1], out_features)


class Int4Linear(nn.Module):
    """A Linear whose weight is 4-bit per group of ``group_size`` input channels (``int4_quantize``): in memory
    ``w`` (N', K/2) uint8 in the kernel's layout and ``scale_zero`` (K/g, N', 2) bfloat16 (N' = N rounded up
    to 16: the kernel's unit; the extra rows are zeros); in its state dict the CPU-independent form ``q``
    (N, K/2) uint8 (``pair_k``), ``scale`` and ``zero`` (N, K/g) bfloat16 and ``bias``."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, group_size: int = GROUP_SIZE,
                 *, shape: tuple | None = None):
        super().__init__()
        N, K = int4_shape(weight.shape if weight is not None else shape, group_size)
        self.in_features, self.out_features, self.group_size = K, N, group_size
        self.layout = _layout()
        if weight is None:                              # filled by load_state_dict (a saved int4 folder)
            q = torch.zeros(N, K // 2, dtype=torch.uint8)
            scale = zero = torch.zeros(N, K // group_size, dtype=torch.bfloat16)
        else:
            codes, scale, zero = int4_quantize(weight, group_size)
            q = pair_k(codes)
        self._set(q, scale, zero, None if bias is None else bias.detach().float().clone())

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool, group_size: int = GROUP_SIZE) -> Int4Linear:
        """One to fill with ``load_state_dict`` (a saved int4 folder), made without a float weight."""
        _layout()                                        # found on the CPU, not under the meta device below
        with torch.device("meta"):
            return cls(None, torch.empty(out_features) if bias else None, group_size,
                       shape=(out_features, in_features))

    def _set(self, q, scale, zero, bias):
        """Buffers from the saved form: q (N, K/2) in ``pair_k``'s layout, scale and zero (N, K/g), bias. Packed
        ``PACK_ROWS`` rows at a time (the layout is local to blocks of 64 rows), so loading a large matrix
        makes no copy of it wider than its packed bytes."""
        N, K = self.out_features, self.in_features
        rows = -(-N // 16) * 16 if self.layout else N
        if self.layout:
            w = torch.empty(rows, K // 2, dtype=torch.uint8, device=q.device)
            for r in range(0, rows, PACK_ROWS):
                codes = unpair_k(q[r:r + PACK_ROWS])
                n = min(PACK_ROWS, rows - r)
                w[r:r + n] = kernel_pack(F.pad(codes, (0, 0, 0, n - codes.shape[0])), self.layout)
        else:
            w = q.contiguous()
        self.register_buffer("w", w)
        self.register_buffer("scale_zero", _scale_zero(scale, zero, rows))
        self.register_buffer("bias", bias)

    def codes(self) -> torch.Tensor:
        """(N, K) uint8 in [0, 15]."""
        return (kernel_unpack(self.w, self.layout) if self.layout else unpair_k(self.w))[:self.out_features]

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_zero[:, :self.out_features, 0].T.contiguous()

    @property
    def zero(self) -> torch.Tensor:
        return self.scale_zero[:, :self.out_features, 1].T.contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (N, K) float32: what the products compute with."""
        return int4_dequantize(self.codes(), self.scale, self.zero)

    def forward(self, x):
        f = int4_linear if _direct(x) else torch.ops.subquad.int4_linear
        return f(x, self.w, self.scale_zero, self.bias, self.out_features, self.layout)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.layout:                   # pair_k(codes), paired in the k-major order: half the bytes to transpose
            ct = kernel_unpack_t(self.w, self.layout)[:, :self.out_features]
            destination[prefix + "q"] = (ct[0::2] | ct[1::2] << 4).T.contiguous()
        else:
            destination[prefix + "q"] = self.w
        destination[prefix + "scale"] = self.scale
        destination[prefix + "zero"] = self.zero
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        N, K, G = self.out_features, self.in_features, self.in_features // self.group_size
        want = {"q": ((N, K // 2), torch.uint8), "scale": ((N, G), torch.bfloat16), "zero": ((N, G), torch.bfloat16)}
        if self.bias is not None:
            want["bias"] = ((N,), torch.float32)
        got = {}
        for name, (shape, dtype) in want.items():
            t = state_dict.get(prefix + name)
            if t is None:
                missing_keys.append(prefix + name)
            elif tuple(t.shape) != shape or t.dtype != dtype:
                error_msgs.append(f"{prefix + name}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
            else:
                got[name] = t
        if len(got) == len(want):
            self._set(got["q"], got["scale"], got["zero"], got.get("bias"))
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in want)

    def extra_repr(self):
        how = "torch's int4 kernel" if self.layout else "dequantising"
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 per {self.group_size} "
                f"inputs ({how})")


def int4_shape(shape, group_size: int) -> tuple[int, int]:
    """(N, K) of an (out, in) weight int4 can hold with ``group_size``; ValueError naming what does not fit."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4's group_size must be one of {', '.join(map(str, GROUP_SIZES))} (the sizes torch's "
                         f"int4 kernel takes), got {group_size!r}")
    if len(shape) != 2:
        raise ValueError(f"Int4Linear needs a (out, in) weight, got shape {tuple(shape)}")
    if shape[1] % group_size:
        raise ValueError(f"Int4Linear: the weight's input width {shape[1]} is not a multiple of group_size="
                         f"{group_size}")
    return int(shape[0]), int(shape[1])


def quantized_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     group_size: int = GROUP_SIZE) -> nn.Module:
    if kind == "int4":
        return Int4Linear(weight, bias, group_size)
    return (Int8Linear if kind == "int8" else Bf16Linear)(weight, bias)


def quantize(model, kind: str, min_weights: int = MIN_WEIGHTS, group_size: int | None = None):
    """Quantise ``model`` (a ``LanguageModel``) in place for inference (module doc) and return it.

    Every ``nn.Linear`` of at least ``min_weights`` weights (``MIN_WEIGHTS``; 0: all) (but those a layer reads
    as a matrix, listed in its ``keep_float``: MLA's absorbed ``kv_b_proj``) becomes an ``Int8Linear`` /
    ``Int4Linear`` / ``Bf16Linear`` (the output of a 1-output gate too), every mixture-of-experts layer gets
    one per expert and projection, and the vocabulary head (tied or not) one of its own. int4 also leaves the
    projections named in ``INT4_FLOAT`` in float32, and makes every matrix whose input width is not a multiple
    of ``group_size`` an ``Int8Linear`` (experts: float32; a warning names them). Refused: an unknown kind or
    group size, a model that is not float32 (quantise from float32 weights), a model already quantised."""
    from subquad.models.moe import MoE

    if kind not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {kind!r}")
    group_size = GROUP_SIZE if group_size is None else group_size
    if kind == "int4":
        int4_shape((1, group_size), group_size)                      # the group size, checked first
    if getattr(model, "quantized", None):
        raise ValueError(f"the model is already quantised ({model.quantized})")
    dtype = model.embed.weight.dtype
    if dtype != torch.float32:
        raise ValueError(f"quantize needs a float32 model (it keeps the rest in float32), got {dtype}; load it "
                         f"with dtype=float32")
    model.eval()
    eights, skipped, small, made = [], [], [], 0

    def kind_of(name, w, to):                   # int4: a width the groups divide; else int8 (or float), named
        if kind != "int4" or w.shape[-1] % group_size == 0:
            return kind
        to.append(name)
        return "int8" if to is eights else None

    for mname, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name not in getattr(module, "keep_float", ()) and \
                    child.weight.numel() >= min_weights and not (kind == "int4" and name in INT4_FLOAT):
                to = kind_of(f"{mname}.{name}", child.weight, eights)
                setattr(module, name, quantized_linear(to, child.weight, child.bias, group_size))
                made += 1
            elif isinstance(child, nn.Linear) and child.weight.numel() < min_weights:
                small.append(f"{mname}.{name}")
        if isinstance(module, MoE) and module.w_up[0].numel() >= min_weights and \
                all([kind_of(f"{mname}.{n}", getattr(module, n), skipped) for n in module.projections]):
            module.quantize_experts(lambda w: quantized_linear(kind, w, None, group_size))
    head = model.embed.weight if model.head is None else model.head.weight
    model.head = quantized_linear(kind_of("head", head, eights), head, None, group_size)   # a tied head: a copy
    if len(small) > made:                        # a small model: asking for 8 or 4 bits changed little - say so
        warnings.warn(f"{kind}: {len(small)} of {len(small) + made} projections have fewer than {min_weights:,} "
                      f"weights and stay float32 (their products are as fast in float32; quantize(..., "
                      f"min_weights=0) takes them too); the vocabulary head is quantised", stacklevel=2)
    for what, names in (("take 8 bits per output channel", eights), ("stay float32 (experts)", skipped)):
        if names:
            warnings.warn(f"int4 with group_size={group_size}: {len(names)} matrices whose input width it does not "
                          f"divide {what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}", stacklevel=2)
    model.quantized = kind
    model.quant_group_size = group_size if kind == "int4" else None
    for p in model.parameters():
        p.requires_grad_(False)
    from subquad.layers.mamba import forget_block_steps

    forget_block_steps(model)                    # steps kept for the float weights (layers.mamba.planned_block)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Quantised folders

def load_quantized(path, c: dict):
    """The quantised ``LanguageModel`` of a folder ``hf.saver.save_quantized`` wrote (config.json ``c``), its quantised
    matrices as they were saved (bit for bit; int4 packed again for this CPU's kernel). No float copy of a
    quantised matrix is made: the model is built on the meta device, each quantised module is made empty from
    its saved shapes, and the tensors are moved in module by module (peak: the file's tensors plus one
    module's packed copy)."""
    from collections import defaultdict

    from subquad.models.config import ModelConfig
    from subquad.models.decode import decode_layout
    from subquad.models.hf.common import read_weights
    from subquad.models.lm import LanguageModel

    q = c.get("quantization")
    kind = q.get("kind") if isinstance(q, dict) else None
    if kind not in QUANTIZE + ("f16",):               # f16: a GGUF file's F16 matrices as loaded (F16Linear)
        raise ValueError(f"{path}: config.json's quantization.kind must be one of {', '.join(QUANTIZE)} or f16, "
                         f"got {kind!r}")
    group_size = q.get("group_size") if kind == "int4" else None
    if kind == "int4":
        int4_shape((1, group_size), group_size)
    if not isinstance(c.get("config"), dict):
        raise ValueError(f"{path}: config.json of model_type 'subquad' has no 'config' object "
                         "(the model's ModelConfig)")
    cfg = ModelConfig.from_dict(c["config"])
    with torch.device("meta"):                        # no memory, no random init
        model = LanguageModel(cfg)
    tensors = read_weights(path)

    def empty(N, K, bias):                            # a quantised module to fill, made from its saved shapes
        if kind == "int4":
            return Int4Linear.empty(N, K, bias, group_size)
        return {"int8": Int8Linear, "bf16": Bf16Linear, "f16": F16Linear}[kind].empty(N, K, bias)

    def empty_for(name, N, K):                        # int8 per block (a GGUF file's types): from the scale's shape
        s = tensors.get(name + ".scale")
        if kind == "int4" and tensors[name + ".q"].dtype == torch.int8:   # a width the groups do not divide
            return Int8Linear.empty(N, tensors[name + ".q"].shape[1], name + ".bias" in tensors)
        if kind == "int8" and s is not None and s.dim() == 2:
            packed = tensors[name + ".q"].dtype == torch.uint8          # Q4_0's nibbles: K = 2 x its bytes
            return Int8Linear.empty(N, 2 * tensors[name + ".q"].shape[1] if packed else K, name + ".bias" in tensors,
                                    s.shape[1], name + ".offset" in tensors, packed)
        return empty(N, K, name + ".bias" in tensors)

    mark = ".w" if kind in ("bf16", "f16") else ".q"  # a quantised module saves this in place of ``weight``
    for name in sorted(k[:-len(mark)] for k in tensors if k.endswith(mark)):
        if ".quantized_experts." in name:             # a mixture's experts: made below, all at once
            continue
        w = tensors[name + mark]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                empty_for(name, w.shape[0], w.shape[1] * (2 if kind == "int4" else 1)))
    for moe in sorted({k.split(".quantized_experts.")[0] for k in tensors if ".quantized_experts." in k}):
        m = model.get_submodule(moe)
        names = iter(f"{moe}.quantized_experts.{n}.{e}" for n in m.projections for e in range(getattr(m, n).shape[0]))
        m.quantize_experts(lambda w: empty_for(next(names), w.shape[0], w.shape[1]))   # a GGUF file's: per block
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: the quantised checkpoint does not match its config: missing "
                         f"{', '.join(missing[:5]) or 'none'}; unexpected {', '.join(unexpected[:5]) or 'none'}")
    groups = defaultdict(list)                        # tensors by the module that holds them
    for k in tensors:
        groups[k.rpartition(".")[0]].append(k)
    modules = dict(model.named_modules())
    for owner, keys in groups.items():
        part = {k.rpartition(".")[2]: tensors.pop(k) for k in keys}
        modules[owner].load_state_dict(part, strict=False, assign=True)
        del part
        release_freed()
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{path}: not filled by the checkpoint: {', '.join(left[:5])}")
    decode_layout(model)          # the float matrices left, as from_pretrained lays them out before quantising
    model.quantized, model.quant_group_size = kind, group_size
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
