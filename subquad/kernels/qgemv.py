"""Quantised weights times a few float32 rows in C (``qgemv.c``): a decoding step's int8 and int4 products.

    int8   y = x (q * scale - offset)^T + bias     q (N, K) int8, scale/offset (N, G) per group of K/G inputs
                                                    (G = 1: per output channel; offset None: symmetric)
    int4   y = x~ ((c - 8) s + z)^T + bias         c (N, K) in [0, 15] in torch's packed int4 layout
                                                    (``models.quant.LAYOUTS``), s, z bfloat16 per group,
                                                    x~ = x rounded to int8 per block of 32 (``int8q``)
    int8q  y = x~ (q * scale)^T + bias             q (N, K) int8 per output channel, or per block of 32 (Q8_0)
    q4_0   y = x~ ((u - 8) * scale)^T + bias       u (N, K) nibbles as a GGUF file's Q4_0 blocks pack them, scale
                                                    per block of 32

int8 keeps x float32 (exact: GGUF files' Q6_K and offset blocks, 1e-5 of their dequantised product); int8q
(GGUF's Q8_0 too) and int4
round it to int8 per block of 32 with a float scale, as llama.cpp's Q8_0 / Q4_0 products do (fbgemm's int8 kernel
rounds it to 7-8 bits per call, torch's int4 kernel to bfloat16): integer sums, about twice the weights per
instruction. Either way a row's result does not depend on the rows beside it. Each weight byte is read once per
call for all its rows. Used by ``models.quant`` for products of a few float32 rows on the CPU (``INT8_ROWS``,
``INT8Q_ROWS``, ``INT4_ROWS``: where they measure faster) when the library builds (``kernels.enabled``), and
by the Mamba blocks' kernels; the naive reference is the dequantised product (``Int8Linear.dequantized``,
``quant.int4_dequantize``) times x (or x~), which the tests hold it to in float64.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from subquad.kernels import I64, INT, PTR, Kernel, derived, enabled

# Up to how many rows the C kernels are faster than what else runs (benchmarks/bench_qgemv.py; AMD EPYC, AVX2):
# int8 per block (a GGUF Q8_0 / Q6_K / Q4_K file's matrices; Q8_0 with x rounded, int8q) against the
# dequantised product: 3.4-8x at one row, 1.5-3x at 8; int8 per channel with x exact against fbgemm's kernel:
# slower at every row count, so only where fbgemm is gone; int4 (x rounded per block of 32) against torch's
# kernel, weights read from memory: 1.6-3.7x at one row, 1.1-1.6x at 2-8, 1.2-1.4x at 12-16.
INT8_ROWS = 8
INT4_ROWS = 16
# int8 per channel with x rounded to int8 per block of 32 (int8q_gemv) against fbgemm's kernel, weights read from
# memory (bench_qgemv.py --from-memory): 1.3-1.6x faster at one row, 1.0-1.2x at 2, slower from 4 (16 rows:
# 2-2.7x slower). Inside a Mamba block's one call it is taken up to BLOCK_INT8Q_ROWS rows: there the call saves
# more than the products lose (the whole step at 4 rows 0.74x of the modules' with fbgemm; RESULTS.md).
INT8Q_ROWS = 2
# Beyond those, with Sapphire Rapids' AMX tiles (int8_amx: rows rounded to 8 bits each, 16 rows a tile) against
# fbgemm's kernel, weights read from memory, this Intel Xeon: 1.2-1.6x faster at 3-16 rows at mamba-130m's matrices
# (benchmarks/RESULTS.md, "int8 through AMX tiles"); models.quant.int8_linear takes them at any rows (a prompt's
# too: 4-5x the dequantised product at 2,048), the blocks' one calls (layers.mamba.kernel_weight) up to AMX_ROWS.
# Without the tiles, AVX-512 VNNI's vectors on the same packed weights (``packed_int8() == 2``): on an AMD EPYC
# (Zen 4) 1.2-1.5x fbgemm's speed at 1-8 rows, 0.97-1.15x at 16 (RESULTS.md, "int8's packed weights through
# vectors"), ~2x the dequantised product over a 2,048-token prompt: taken at any rows, 16 at a time, as the tiles.
AMX_ROWS = 16
BLOCK_INT8Q_ROWS = 4
# A GGUF file's Q8_0 and Q4_0 matrices (x rounded per block of 32: int8q_gemv, q4_0_gemv) against the dequantised
# product a product of more rows would take, weights read from memory at mamba-130m's matrices: 4-15x faster at
# 8, 12 and 16 rows (benchmarks/RESULTS.md, "Q4_0 in pairs of blocks"), so a decoding step's rows up to C_ROWS
# (``models.mode.decoding``: a prompt's rows stay exact, as int8's do); blocks with x exact (int8_gemv: Q6_K,
# offsets) keep INT8_ROWS (at 16 rows 0.9x the dequantised in_proj).
ROUNDED_ROWS = 16
# bfloat16 weights (models.quant.Bf16Linear) up to BF16_ROWS rows through bf16_gemv, its AMX-BF16 tiles from
# BF16_TILE_ROWS rows where the CPU has them (benchmarks/RESULTS.md, "bfloat16 products in C").
BF16_ROWS = 16
BF16_TILE_ROWS = 3
# float16 weights (a GGUF file's F16 matrices: models.quant.F16Linear) up to F16_ROWS rows through f16_gemv.
F16_ROWS = 16
# From this many rows f32_gemv computes outer-product tiles (qgemv.c's TILE_ROWS; the tests hold the two equal):
# compute-bound where dot products of 8-16 rows reached about half the matmul rate (RESULTS.md).
F32_TILE_ROWS = 3

# SUBQUAD_Q8_0_EXACT=1: a GGUF file's Q8_0 matrices keep x exact at a few rows too (1e-5 of their dequantised
# product, as more rows compute it; about twice the time per weight of rounding x as llama.cpp does).
Q8_0_EXACT = os.environ.get("SUBQUAD_Q8_0_EXACT") == "1"


def rounds_x(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> bool:
    """Whether a blocked product of a few rows (``models.quant.int8_block_linear``, a Mamba block's one call)
    rounds x per block of 32 (``int8q_gemv``, ``q4_0_gemv``): Q8_0's and Q4_0's form - blocks of 32, no offsets,
    q int8 codes or Q4_0's packed nibbles (uint8, two a byte) - unless ``Q8_0_EXACT``."""
    K = q.shape[1] * (2 if q.dtype == torch.uint8 else 1)
    return not Q8_0_EXACT and offset is None and scale.dim() == 2 and scale.shape[1] * 32 == K


INT8 = Kernel("int8_gemv", [I64, I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR], "qgemv")
F32 = Kernel("f32_gemv", [I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR], "qgemv")
INT8Q = Kernel("int8q_gemv", [I64, I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR], "qgemv")
Q4_0 = Kernel("q4_0_gemv", [I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR], "qgemv")
INT8_AMX = Kernel("int8_amx_gemv", [I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR], "qgemv")
AMX_PACK = Kernel("int8_amx_pack", [I64, I64, PTR, PTR], "qgemv")
_AMX_INIT = Kernel("int8_amx_init", [PTR], "qgemv")
BF16 = Kernel("bf16_gemv", [I64, I64, I64, INT, INT, PTR, I64, PTR, PTR, PTR, PTR], "qgemv")
_BF16_INIT = Kernel("bf16_init", [PTR], "qgemv")
F16 = Kernel("f16_gemv", [I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR], "qgemv")
_F16_INIT = Kernel("f16_init", [PTR], "qgemv")
INT4 = Kernel("int4_gemv", [I64, I64, I64, I64, I64, I64, INT, INT, PTR, I64, PTR, PTR, PTR, PTR], "qgemv")
_INT4_INIT = Kernel("int4_init", [PTR], "qgemv")


def usable(kernel: Kernel, x: torch.Tensor, rows: int) -> bool:
    """Whether ``kernel`` may take x (..., K): float32 on the CPU, 1 to ``rows`` rows, kernels on and built."""
    return x.dtype == torch.float32 and x.is_cpu and 0 < x.numel() <= rows * x.shape[-1] \
        and enabled() and kernel.available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) float32 (``usable``), q (N, K) int8, scale (N,) or (N, G), offset like scale or None, bias (N,)
    or None -> (..., N) float32."""
    x2 = _rows(x)
    M, K = x2.shape
    N = q.shape[0]
    G = 1 if scale.dim() == 1 else scale.shape[1]
    y = x2.new_empty(M, N)
    scratch = x2.new_empty(M * G)
    INT8(M, N, K, G, torch.get_num_threads(), x2, x2.stride(0), q, scale, offset, bias, y, scratch)
    return y.view(*x.shape[:-1], N)


def int8_amx(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             key: int) -> torch.Tensor:
    """x (..., K) float32 (``usable``, ``packed_int8()``), any rows (16 a tile); q (N, K) int8, scale (N,) float32,
    bias (N,) or None -> (..., N) float32, each row of x rounded to int8 with one scale of its own (``qgemv.c``'s
    int8_amx_gemv). q's tile layout is made on the first call and kept under ``key`` (one per matrix; remade when
    q's storage or version changes). A K that is not a multiple of 64 is padded with zeros, in the packed weights
    and in x's rows: they add nothing to a sum, nor to a row's largest |x| - the same result."""
    x2 = _rows(x)
    (M, K), N = x2.shape, q.shape[0]
    if K % 64:
        x2, K = torch.nn.functional.pad(x2, (0, -K % 64)), K + (-K % 64)
    p = amx_packed(q, key)
    y, codes, d = x2.new_empty(M, N), torch.empty(_padded(M) * K, dtype=torch.uint8), x2.new_empty(M)
    INT8_AMX(M, N, K, torch.get_num_threads(), x2, x2.stride(0), p, scale, bias, y, codes, d)
    return y.view(*x.shape[:-1], N)


AMX_PACKED: dict = {}      # key -> ((q's storage, its version), the packed bytes); models.quant drops a module's


def _padded(N: int) -> int:
    return (N + 15) // 16 * 16


def amx_packed(q: torch.Tensor, key: int) -> torch.Tensor:
    """q (N, K) int8 in AMX tiles (``qgemv.c``'s int8_amx_pack; K padded with zeros to a multiple of 64) with the
    rows' int32 sums after them: one int8 tensor of Np Kp + 4 Np bytes (Np = N rounded up to 16), made once per
    (key, storage, version) of q - the block kernels' projection kind 9 reads the same bytes (a K that is a
    multiple of 64 only: ``layers.mamba.kernel_weight``)."""
    return derived(AMX_PACKED, key, q, _amx_pack)     # kept calls holding it: valid while q stays


def _amx_pack(q: torch.Tensor) -> torch.Tensor:
    if q.shape[1] % 64:
        q = torch.nn.functional.pad(q, (0, -q.shape[1] % 64))
    (N, K), Np = q.shape, _padded(q.shape[0])
    p = torch.empty(Np * K + 4 * Np, dtype=torch.int8)
    AMX_PACK(N, K, q.contiguous(), p)
    return p


@lru_cache(maxsize=None)
def packed_int8() -> int:
    """How int8_amx runs here: 1 through AMX tiles (the kernels built with AMX-INT8 - Sapphire Rapids and later -
    and Linux granted this process the tiles' state), 2 through AVX-512 VNNI's vectors on the same packed weights
    and the same integer sums (Zen 4, Ice Lake, or tiles refused), 0 not at all; ``SUBQUAD_AMX=0`` in the
    environment: 0 (fbgemm's kernel and the block kernels' int8 rows as before)."""
    if os.environ.get("SUBQUAD_AMX") == "0" or not _AMX_INIT.available():
        return 0
    out = torch.zeros(1, dtype=torch.int32)
    _AMX_INIT(out)
    return int(out.item())


def block_int8q_rows() -> int:
    """Up to how many rows a block kernel's int8 product rounds x per block of 32 (int8q): ``BLOCK_INT8Q_ROWS``
    where the CPU has neither AMX tiles nor AVX-512 VNNI, else none - the packed weights take every row count, as
    ``models.quant.int8_linear`` gives them, so a row's result does not depend on how many rows a call holds
    (a served stream equals ``generate`` alone); on the Zen 4 host they are faster at one row too (98 against
    119 us for mamba-130m's in_proj, 923 against 1,119 for its head; benchmarks/RESULTS.md)."""
    return 0 if packed_int8() else BLOCK_INT8Q_ROWS


def amx() -> bool:
    """Whether int8_amx runs through AMX tiles (``packed_int8() == 1``, derived: one cache to clear): then at any
    rows, a prompt's too."""
    return packed_int8() == 1


@lru_cache(maxsize=None)
def bf16() -> int:
    """What bf16_gemv may use: 0 nothing (not built with AVX512-BF16, or the kernels off), 1 its vectors
    (Sapphire Rapids, Zen 4), 2 the AMX-BF16 tiles too (Sapphire Rapids, the tiles' state granted;
    ``SUBQUAD_AMX=0``: not)."""
    if not BF16.available():
        return 0
    out = torch.zeros(1, dtype=torch.int32)
    _BF16_INIT(out)
    return min(int(out.item()), 1 if os.environ.get("SUBQUAD_AMX") == "0" else 2)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tiles: bool | None = None) -> torch.Tensor:
    """x (..., K) float32 (``usable``, ``bf16()``), K a multiple of 32, at most 16 rows; w (N, K) bfloat16, bias
    (N,) float32 or None -> (..., N) float32: x rounded to bfloat16, float32 sums (``qgemv.c``'s bf16_gemv;
    ``tiles``: through AMX-BF16, by default where ``bf16()`` offers them from BF16_TILE_ROWS rows)."""
    x2 = _rows(x)
    (M, K), N = x2.shape, w.shape[0]
    if tiles is None:
        tiles = M >= BF16_TILE_ROWS and bf16() == 2
    y = x2.new_empty(M, N)
    BF16(M, N, K, torch.get_num_threads(), int(tiles), x2, x2.stride(0), w, bias, y,
         torch.empty(M * K, dtype=torch.int16))
    return y.view(*x.shape[:-1], N)


@lru_cache(maxsize=None)
def int4_rows() -> int:
    """Up to how many float32 rows ``int4_gemv`` is taken: any (a prompt's too) where it was built with AVX-512
    VNNI and VBMI - a block's rows 16 at a time, each block of weights unpacked once for them - else
    ``INT4_ROWS``; 0 where it is not built."""
    if not INT4.available():
        return 0
    out = torch.zeros(1, dtype=torch.int32)
    _INT4_INIT(out)
    return 1 << 62 if out.item() else INT4_ROWS


@lru_cache(maxsize=None)
def f16() -> int:
    """The width f16_gemv needs K to be a multiple of (16 with AVX-512, 8 with AVX2 and F16C), or 0: not built."""
    if not F16.available():
        return 0
    out = torch.zeros(1, dtype=torch.int32)
    _F16_INIT(out)
    return int(out.item())


def f16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) float32 (``usable``), K a multiple of ``f16()``, at most 16 rows; w (N, K) float16, bias (N,)
    float32 or None -> (..., N) float32: x exact, the halves widened to float32 (``qgemv.c``'s f16_gemv)."""
    x2 = _rows(x)
    (M, K), N = x2.shape, w.shape[0]
    y = x2.new_empty(M, N)
    F16(M, N, K, torch.get_num_threads(), x2, x2.stride(0), w, bias, y)
    return y.view(*x.shape[:-1], N)


def q4_0_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) float32 (``usable``), K a multiple of 32, q (N, K / 2) uint8 as a GGUF file's Q4_0 blocks hold
    their nibbles (16 bytes a block: byte j = value j low, value 16 + j high; w = (u - 8) scale), scale (N, K / 32)
    float32, bias (N,) or None -> (..., N) float32, x's rows rounded to int8 per block of 32 (llama.cpp's Q4_0 x
    Q8_0 product; ``qgemv.c``'s q4_0_gemv)."""
    x2 = _rows(x)
    (M, K), N = x2.shape, q.shape[0]
    y, codes, d = _rounding_scratch(x2, N)
    Q4_0(M, N, K, torch.get_num_threads(), x2, x2.stride(0), q, scale, bias, y, codes, d)
    return y.view(*x.shape[:-1], N)


def _rounding_scratch(x2: torch.Tensor, N: int):
    """y (M, N) and what a kernel that rounds x (M, K) per block of 32 writes first: codes (M K) int8, scales."""
    M, K = x2.shape
    return x2.new_empty(M, N), torch.empty(M * K, dtype=torch.int8), x2.new_empty(M * (K // 32))


def int4_gemv(x: torch.Tensor, w: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None,
              out_features: int, block: int, split: bool) -> torch.Tensor:
    """x (..., K) float32 (``usable``), w (N', K/2) uint8 in torch's packed layout of ``block``-row blocks
    (``split``: a byte holds rows j and j + block/2), scale_zero (K/g, N', 2) bfloat16, bias (N,) or None ->
    (..., N) float32, N = ``out_features``."""
    x2 = _rows(x)
    M, K = x2.shape
    G, Np = scale_zero.shape[0], scale_zero.shape[1]
    y = x2.new_empty(M, out_features)
    INT4(M, out_features, Np, K, G, block, int(split), torch.get_num_threads(), x2, x2.stride(0), w, scale_zero,
         bias, y)
    return y.view(*x.shape[:-1], out_features)


def f32_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) float32 (``usable``), w (N, K) float32 contiguous, bias (N,) or None -> (..., N) float32."""
    x2 = _rows(x)
    M, K = x2.shape
    N = w.shape[0]
    y = x2.new_empty(M, N)
    F32(M, N, K, torch.get_num_threads(), x2, x2.stride(0), w, bias, y)
    return y.view(*x.shape[:-1], N)


def int8q_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) float32 (``usable``), K a multiple of 32, q (N, K) int8 with |q| <= 127, scale (N,) float32 or
    (N, K / 32) (per block of 32: GGUF's Q8_0), bias (N,) or None -> (..., N) float32, x's rows rounded to int8
    per block of 32 (``qgemv.c``'s int8q_gemv: y = scale (sum_b d_b q_b . c_b) + bias, or per block
    sum_b scale_b d_b q_b . c_b + bias, x_b ~ d_b c_b)."""
    x2 = _rows(x)
    (M, K), N = x2.shape, q.shape[0]
    y, codes, d = _rounding_scratch(x2, N)
    G = 1 if scale.dim() == 1 else scale.shape[1]
    INT8Q(M, N, K, G, torch.get_num_threads(), x2, x2.stride(0), q, scale, bias, y, codes, d)
    return y.view(*x.shape[:-1], N)


def proj_args(w) -> tuple:
    """(weight, scale, kind, groups) as the block kernels take a projection (``qgemv.c``'s proj_gemv): ``w`` a
    float32 matrix, row-major (kind 0) or column-major (1), or already such a tuple
    (``layers.mamba.kernel_weight``: int8 per output channel, kind 2; int4 in torch's packed layout, 3-5; int8
    per block of inputs, x exact, 6, or x rounded per block (Q8_0), 7; Q4_0's packed nibbles, 8; int8 in AMX
    tiles, 9; bfloat16, 10, groups 1 through its tiles; float16, 11)."""
    if isinstance(w, tuple):
        return w
    return w, None, int(not w.is_contiguous()), 0
