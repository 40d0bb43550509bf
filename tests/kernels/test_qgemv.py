"""The products in C (kernels/qgemv.c) against float64: float32 weights, and the dequantised weights: int8 per
channel and per block (with and without offsets, GGUF's Q8_0 / Q4_1-like forms), int4 in every packed layout
torch's kernel uses (blocks of 64 and 32 rows, split or in pairs, a last shorter block), odd widths, 1 to 16 rows,
a strided x; a row's result does not depend on the rows beside it; the kernels off, the library falls back."""

from __future__ import annotations

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models import quant
from subquad.models.mode import decoding

pytestmark = pytest.mark.skipif(not qgemv.INT8.available(), reason="no C compiler: the kernel cannot be built")


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("M,N,K,G,offset,bias", [
    (1, 3072, 768, 1, False, False),      # mamba-130m's in_proj, one row
    (3, 77, 96, 1, False, True),          # odd width (not a multiple of the 4 rows a pass takes)
    (16, 50, 64, 2, True, True),          # blocks with offsets, the most rows
    (5, 33, 128, 4, True, False),
    (2, 9, 40, 1, False, False),          # K not a multiple of 16: the scalar tail
    (4, 64, 96, 3, False, True),          # blocks of 32 (Q8_0) without offsets
])
def test_int8_against_the_dequantised_weight(M, N, K, G, offset, bias):
    g = torch.Generator().manual_seed(M * 1000 + N)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, G, generator=g) + 0.01 if G > 1 else torch.rand(N, generator=g) + 0.01
    off = torch.randn(N, G, generator=g) if offset else None
    b = torch.randn(N, generator=g) if bias else None
    xx = torch.randn(M, K + 5, generator=g)
    x = xx[:, 2:K + 2]                                          # a row stride that is not K
    W = q.double().view(N, G, K // G) * scale.double().view(N, G, 1)
    if off is not None:
        W = W - off.double()[..., None]
    ref = x.double() @ W.reshape(N, K).T + (0 if b is None else b.double())
    got = qgemv.int8_gemv(x, q, scale, off, b)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert _rel(got, ref) <= 1e-6
    for m in range(M):                                          # a row alone gives the same bits
        assert torch.equal(qgemv.int8_gemv(x[m:m + 1], q, scale, off, b)[0], got[m])


def q8_rows(x):
    """x (M, K) float32 -> (codes (M, K) as float64, d (M, K/32) float64): per block of 32, c = round(127 x / max|x|)
    (half to even, as the kernel's rounding) in float32 - the kernel's own arithmetic, written with torch ops."""
    M, K = x.shape
    b = x.reshape(M, K // 32, 32)
    mx = b.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros_like(mx))
    return torch.round(b * inv).reshape(M, K).double(), (mx / 127).squeeze(-1).double()


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("M,N,K,bias", [
    (1, 3072, 768, False),                # mamba-130m's in_proj, one row
    (2, 77, 96, True),                    # an odd number of blocks (the tail), odd N
    (4, 33, 32, True),                    # one block
    (7, 45, 224, True),                   # rows past a multiple of 4 (AVX-512 VNNI takes 4 at a time), 7 blocks
    (1, 45, 224, True),                   # one row: weight rows in pairs, an odd one last
    (16, 50, 1536, False),                # the most rows a block kernel takes
])
def test_int8q_against_its_math_and_the_bound(M, N, K, bias, blocked):
    """y = scale sum_b d_b (q . c)_b + bias with x's codes per block of 32 (``blocked``: a scale per row and block
    of 32, GGUF's Q8_0 - llama.cpp's own product): against that sum in float64 from the codes computed here, and
    within half a code per input of the float64 product with x itself (a bound that does not depend on how x is
    rounded)."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)    # -128 too: no 16-bit pair overflows
    scale = torch.rand(N, K // 32 if blocked else 1, generator=g) + 0.01
    ws = scale.double()                                          # (N, blocks) or (N, 1): per block or channel
    scale = scale if blocked else scale[:, 0]
    b = torch.randn(N, generator=g) if bias else None
    xx = torch.randn(M, K + 5, generator=g) * torch.logspace(-3, 3, M)[:, None]
    x = xx[:, 2:K + 2]                                          # a row stride that is not K
    x[0, :32] = 0.0                                             # an all-zero block: d = 0, no division by it
    got = qgemv.int8q_gemv(x, q, scale, b)
    assert got.shape == (M, N) and got.dtype == torch.float32
    c, d = q8_rows(x.contiguous())
    qd = q.double().view(N, K // 32, 32)
    sums = torch.einsum("nbk,mbk->mnb", qd, c.view(M, K // 32, 32))
    ref = (sums * d[:, None, :] * ws[None]).sum(-1) + (0 if b is None else b.double())
    assert _rel(got, ref) <= 2e-6
    W = (qd * ws[..., None]).reshape(N, K)
    exact = x.double() @ W.T + (0 if b is None else b.double())
    bound = (qd.abs().sum(-1)[None] * ws[None] * d[:, None, :] / 2).sum(-1)      # (M, N)
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-5) + 1e-6 * exact.abs().max()).all()
    for m in range(M):                                          # a row alone gives the same bits
        assert torch.equal(qgemv.int8q_gemv(x[m:m + 1], q, scale, b)[0], got[m])


def test_int8q_is_exact_for_x_on_its_grid():
    """x whose blocks are codes times a power of two, one code 127: rounding x changes nothing, so the product
    equals the float64 one to float32's summation."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (40, 256), dtype=torch.int8, generator=g)
    scale = torch.rand(40, generator=g) + 0.5
    codes = torch.randint(-127, 128, (3, 256), generator=g).float()
    codes[:, ::32] = 127.0
    x = codes * 2.0 ** torch.randint(-4, 4, (3, 8), generator=g).float().repeat_interleave(32, 1)   # d = 2^e
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    assert _rel(qgemv.int8q_gemv(x, q, scale, None), ref) <= 1e-6


@pytest.mark.parametrize("M,N,K,bias", [
    (1, 3072, 768, False),                # mamba-130m's in_proj, one row
    (2, 771, 1536, True),                 # rows past the last block of 4 (771 = 4 x 192 + 3)
    (3, 64, 37, True),                    # K not a multiple of 8: the scalar tail; an odd row of x
    (qgemv.F32_TILE_ROWS, 771, 1536, True),  # the tiles from here: 12 weight rows x 8 rows of x, 3 rows past them
    (8, 40, 300, False),                  # K past two blocks of KB = 128 inputs, a shorter third
    (9, 50, 96, True),                    # 6 weight rows x 16 rows of x, 7 of them zero, 2 weight rows past
    (16, 3072, 768, False),               # the most rows, mamba-130m's in_proj
    (16, 26, 45, True),                   # 16-k steps then a tail of 13 inputs; 2 weight rows past the tiles
    (16, 50, 300, False),                 # 16 rows, a tail inside the third block of KB inputs
    (16, 7, 5, True),                     # fewer weight rows than a tile
])
def test_f32_against_float64(M, N, K, bias):
    """Below F32_TILE_ROWS rows dot products, from there outer-product tiles: both within 1e-6 of float64, and
    a row's bits do not depend on the rows beside it - alone, or (tiles) in another batch of as many rows."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K + 3, generator=g)[:, 1:K + 1]         # a row stride that is not K
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    got = qgemv.f32_gemv(x, w, b)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert _rel(got, ref) <= 1e-6
    if M < qgemv.F32_TILE_ROWS:
        for m in range(M):                                      # a row alone gives the same bits
            assert torch.equal(qgemv.f32_gemv(x[m:m + 1], w, b)[0], got[m])
    else:                                                       # rows reversed, beside other rows: the same bits
        other = torch.cat([x.flip(0), torch.randn(16 - M, K, generator=g)])
        assert torch.equal(qgemv.f32_gemv(other, w, b)[:M].flip(0), got)
        assert torch.equal(qgemv.f32_gemv(x[:qgemv.F32_TILE_ROWS], w, b), got[:qgemv.F32_TILE_ROWS])


@pytest.mark.parametrize("layout", sorted(quant.LAYOUTS))
@pytest.mark.parametrize("M,N,K,gs,bias", [
    (1, 3072, 768, 128, False),
    (4, 304, 256, 32, True),              # a last, shorter block (304 = 4 x 64 + 48)
    (16, 48, 128, 64, True),              # shorter than one block of 64
    (3, 112, 512, 256, False),
    (7, 192, 384, 128, True),             # four rows and then three
    (16, 3352, 768, 128, True),           # a hybrid's in_proj at 16 rows: a block unpacked once for all, 24 pairs last
    (13, 336, 256, 32, False),            # passes of 4, 4, 4 and 1 rows; a last block of 16 rows
    (37, 304, 256, 32, True),             # a prompt's rows: chunks of 16, 16 and 5
    (18, 112, 128, 64, False),            # 16 rows, then 2
])
def test_int4_in_every_packed_layout(layout, M, N, K, gs, bias):
    """The layouts are packed here with quant.kernel_pack (what Int4Linear holds on a CPU with that layout);
    against the dequantised weights times x rounded per block of 32 (``q8_rows``), in float64."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g)
    codes, scale, zero = quant.int4_quantize(w, gs)
    packed = quant.kernel_pack(codes, layout)
    sz = quant._scale_zero(scale, zero, N)
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M)[:, None]
    c, d = q8_rows(x)
    xr = (c.view(M, K // 32, 32) * d[..., None]).view(M, K)
    ref = xr @ quant.int4_dequantize(codes, scale, zero, torch.float64).T + (0 if b is None else b.double())
    block, split = quant.LAYOUTS[layout]
    got = qgemv.int4_gemv(x, packed, sz, b, N, block, split)
    assert got.shape == (M, N)
    assert _rel(got, ref) <= 2e-6
    for m in range(M):                    # each row as alone: rows go four at a time, each its own sums
        assert torch.equal(qgemv.int4_gemv(x[m:m + 1], packed, sz, b, N, block, split)[0], got[m])


def test_int4_of_a_padded_module():
    """Int4Linear pads N to 16 (300 -> 304): the kernel writes only the N real rows (x on its grid: exact)."""
    torch.manual_seed(0)
    lin = quant.Int4Linear(torch.randn(300, 96), torch.randn(300), 32)
    x = torch.randint(-127, 128, (2, 96)).float() / 64
    x[:, ::32] = 127 / 64                                       # d = 1/64 in every block: rounding changes nothing
    if lin.layout == 0:
        pytest.skip("torch has no int4 kernel on this CPU: nothing packed to read")
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    got = qgemv.int4_gemv(x, lin.w, lin.scale_zero, lin.bias, 300, *quant.LAYOUTS[lin.layout])
    assert got.shape == (2, 300) and _rel(got, ref) <= 2e-6


def test_usable_says_when():
    x = torch.randn(3, 64)
    assert qgemv.usable(qgemv.INT8, x, 3) and not qgemv.usable(qgemv.INT8, x, 2)
    assert not qgemv.usable(qgemv.INT8, x[:0], 3)
    assert not qgemv.usable(qgemv.INT8, x.double(), 3)
    assert not qgemv.usable(qgemv.INT8, x.bfloat16(), 3)


def test_int8_modules_take_int8q_for_a_few_rows():
    """A per-channel Int8Linear's product of up to INT8Q_ROWS float32 rows is the kernel's (x rounded per block of
    32), more rows fbgemm's, where the CPU has no packed int8 kernel (AMX, VNNI: then those take every row count,
    tests/kernels/test_amx.py); a width that is not a multiple of 32 never takes it."""
    torch.manual_seed(0)
    lin = quant.Int8Linear(torch.randn(48, 96), torch.randn(48))
    x = torch.randn(qgemv.INT8Q_ROWS, 96)
    want = qgemv.int8_amx(x, lin.q, lin.scale, lin.bias, lin.key_id) if qgemv.packed_int8() else \
        qgemv.int8q_gemv(x, lin.q, lin.scale, lin.bias)
    assert torch.equal(lin(x), want)
    odd = quant.Int8Linear(torch.randn(48, 72))
    r = torch.randn(1, 72)
    assert _rel(odd(r), r.double() @ odd.weight.double().T) <= 2e-2


def test_the_modules_take_it_and_off_means_the_library_paths(monkeypatch):
    """A blocked Int8Linear (a GGUF file's Q8_0 / Q4_K matrices, x exact) and an Int4Linear (x rounded per block
    of 32) take the C kernel for their rows; SUBQUAD_KERNELS=0: the dequantised product (exact) and torch's int4
    kernel (x rounded to bfloat16) - the same weights either way."""
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (64, 96), dtype=torch.int8)
    blocked = quant.Int8Linear.from_blocks(q, torch.rand(64, 3) + 0.1, torch.randn(64, 3), torch.randn(64))
    lin4 = quant.Int4Linear(torch.randn(64, 96), None, 32)
    calls = []
    for k in (qgemv.INT8, qgemv.INT4):
        monkeypatch.setattr(k, "f", (lambda f: lambda *a: calls.append(1) or f(*a))(k._function()))
    x8, x4 = torch.randn(qgemv.INT8_ROWS, 96), torch.randn(qgemv.INT4_ROWS, 96)
    with_kernel = blocked(x8), lin4(x4)
    assert len(calls) == (2 if lin4.layout else 1)
    monkeypatch.setenv("SUBQUAD_KERNELS", "0")
    without = blocked(x8), lin4(x4)
    assert len(calls) == (2 if lin4.layout else 1)
    for a, b, x, lin, tol in zip(with_kernel, without, (x8, x4), (blocked, lin4), (1e-6, 1e-2)):
        r = x.double() @ lin.weight.double().T + (0 if lin.bias is None else lin.bias.double())
        assert _rel(b, r) <= tol
        if lin is lin4 and lin4.layout:                         # the int4 kernel rounds x per block of 32
            c, d = q8_rows(x)
            r = (c.view(len(x), -1, 32) * d[..., None]).view(x.shape) @ lin.weight.double().T
        assert _rel(a, r) <= 1e-6


def test_a_q8_0_matrix_rounds_x_at_a_few_rows_unless_asked_to_keep_it(monkeypatch):
    """``Int8Linear.from_blocks`` with blocks of 32 and no offsets (GGUF's Q8_0): up to ``ROUNDED_ROWS`` rows x is
    rounded per block (``int8q_gemv``, llama.cpp's arithmetic); ``SUBQUAD_Q8_0_EXACT=1`` (``Q8_0_EXACT``) keeps
    it exact (``int8_gemv``, 1e-5 of the dequantised product); blocks of 16 (Q6_K's) and offsets always do."""
    from subquad.models.quant import Int8Linear

    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (48, 128), dtype=torch.int8, generator=g)
    lin = Int8Linear.from_blocks(q, torch.rand(48, 4, generator=g) + 0.1)
    x = torch.randn(3, 128, generator=g)
    exact = x.double() @ lin.weight.double().T
    with torch.no_grad():
        rounded = lin(x)
        assert torch.equal(rounded, qgemv.int8q_gemv(x, lin.q, lin.scale, None)) and _rel(rounded, exact) > 1e-5
        monkeypatch.setattr(qgemv, "Q8_0_EXACT", True)
        assert _rel(lin(x), exact) <= 1e-6
        monkeypatch.setattr(qgemv, "Q8_0_EXACT", False)
        sixteen = Int8Linear.from_blocks(q, torch.rand(48, 8, generator=g) + 0.1)
        assert _rel(sixteen(x), x.double() @ sixteen.weight.double().T) <= 1e-6


@pytest.mark.parametrize("M,N,K,bias", [(1, 3072, 768, False), (3, 77, 96, True), (8, 33, 32, True),
                                        (2, 40, 224, False), (1, 37, 224, True),    # one row: weight rows in pairs
                                        (2, 33, 288, True)])                        # 2 quads + 1: a row alone
def test_q4_0_against_its_math(M, N, K, bias):
    """GGUF's Q4_0 as the file holds it (``pack_q4_0``: two nibbles a byte, a float scale per block of 32) times x
    rounded per block of 32: against sum_b scale_b d_b ((u - 8) . c)_b in float64 from the codes computed here,
    within half a code per input of the float64 product with x, a row alone bit-equal; the packing round-trips."""
    from subquad.models.quant import pack_q4_0, unpack_q4_0

    g = torch.Generator().manual_seed(M * 100 + N)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    packed = pack_q4_0(q)
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2) and torch.equal(unpack_q4_0(packed), q)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | (int(q[0, 16]) + 8) << 4        # GGUF's byte order
    scale = torch.rand(N, K // 32, generator=g) + 0.01
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K + 3, generator=g)[:, 1:K + 1]                 # a row stride that is not K
    got = qgemv.q4_0_gemv(x, packed, scale, b)
    c, d = q8_rows(x.contiguous())
    qd, ws = q.double().view(N, K // 32, 32), scale.double()
    sums = torch.einsum("nbk,mbk->mnb", qd, c.view(M, K // 32, 32))
    ref = (sums * d[:, None, :] * ws[None]).sum(-1) + (0 if b is None else b.double())
    assert _rel(got, ref) <= 2e-6
    exact = x.double() @ (qd * ws[..., None]).reshape(N, K).T + (0 if b is None else b.double())
    bound = (qd.abs().sum(-1)[None] * ws[None] * d[:, None, :] / 2).sum(-1)
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-5) + 1e-6 * exact.abs().max()).all()
    for m in range(M):
        assert torch.equal(qgemv.q4_0_gemv(x[m:m + 1], packed, scale, b)[0], got[m])


def test_a_q4_0_module_keeps_four_bits_and_multiplies_as_llama_cpp_at_a_few_rows(monkeypatch):
    """``Int8Linear.from_blocks`` of Q4_0's packed bytes: half a byte a weight, ``weight`` the dequantised matrix;
    a few rows through ``q4_0_gemv``, more rows (or ``Q8_0_EXACT``) the dequantised product, exact."""
    from subquad.models.quant import Int8Linear, pack_q4_0

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (40, 96), dtype=torch.int8, generator=g)
    scale = torch.rand(40, 3, generator=g) + 0.1
    lin = Int8Linear.from_blocks(pack_q4_0(q), scale)
    assert (lin.in_features, lin.out_features, lin.q.numel()) == (96, 40, 40 * 48) and "Q4_0" in repr(lin)
    W = (q.double().view(40, 3, 32) * scale.double()[..., None]).reshape(40, 96)
    assert torch.equal(lin.weight.double(), W.float().double())
    with torch.no_grad():
        few, many = torch.randn(2, 96, generator=g), torch.randn(qgemv.ROUNDED_ROWS + 1, 96, generator=g)
        assert torch.equal(lin(few), qgemv.q4_0_gemv(few, lin.q, scale, None))
        sixteen = many[:qgemv.ROUNDED_ROWS]              # a decoding step's rows (a served batch's): still the kernel
        with decoding():
            assert qgemv.ROUNDED_ROWS == 16 and torch.equal(lin(sixteen), qgemv.q4_0_gemv(sixteen, lin.q, scale, None))
            assert _rel(lin(many), many.double() @ W.T) <= 1e-6
        assert _rel(lin(sixteen), sixteen.double() @ W.T) <= 1e-6                  # a prompt's: exact
        assert _rel(lin(many), many.double() @ W.T) <= 1e-6
        monkeypatch.setattr(qgemv, "Q8_0_EXACT", True)
        assert _rel(lin(few), few.double() @ W.T) <= 1e-6
    with pytest.raises(ValueError, match="from_blocks"):
        Int8Linear.from_blocks(pack_q4_0(q), torch.rand(40, 6))             # Q4_0's bytes need blocks of 32


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("M", [1, 8, 20])
def test_a_nan_in_a_row_is_a_nan_in_its_outputs(kind, M):
    """A NaN in x (a model diverging) gives NaN in its row's outputs, as x W^T does: the C kernels round x to int8
    by its largest magnitude, which a max skips NaN in - a finite, plausible row came out (|y| ~20-35, a new user's
    trial), and generate's refusal of NaN logits never fired. The other rows keep their finite values. (fbgemm's
    dynamic product, the int8 path at 3-16 rows where the CPU has no AVX-512 VNNI, rounds NaN as it likes.)"""
    torch.manual_seed(0)
    lin = quant.quantized_linear(kind, torch.randn(64, 128), None, group_size=32)
    x = torch.randn(M, 128)
    want = lin(x)
    x[0, 5] = float("nan")
    with torch.no_grad():
        y = lin(x)
    fbgemm = kind == "int8" and 3 <= M <= 16 and quant.FBGEMM and not qgemv.packed_int8()
    assert fbgemm or bool(torch.isnan(y[0]).all()), y[0]
    assert fbgemm or torch.equal(y[1:], want[1:])          # fbgemm rounds all rows by one scale: not per row
