"""int8 products through AMX tiles (kernels/qgemv.c's int8_amx_gemv) against their math in float64: each row of x
rounded to int8 with its own scale (max |x| / 127, to nearest even), exact integer sums, the channels' scales and
bias; odd channel counts (a last block of 16 padded), K of 1-3 tiles, 1 to 40 rows (several tiles of 16), a row
stride that is not K, a zero row; the weights' tiles remade when q changes in place; the int8 modules and the
Mamba block's one call take them for 3-16 rows (and a decoding batch's more). On a CPU without AMX but with
AVX-512 VNNI the same packed weights go through vectors (``qgemv.packed_int8() == 2``): the same integer sums, so
the same tests, for 3-16 rows and a decoding batch's more, never a prompt's; without either the kernel is never
offered and the modules keep their other paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models.mode import decoding
from subquad.models.quant import Int8Linear

pytestmark = pytest.mark.skipif(not qgemv.INT8.available(), reason="no C compiler: the kernel cannot be built")


def _cpu_has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " amx_int8" in flags and " amx_tile" in flags


def _math(x, q, scale, bias):
    """The product as int8_amx defines it, in float64: rows rounded per row, integer sums, scales."""
    d = x.double().abs().amax(1, keepdim=True) / 127
    c = torch.where(d > 0, torch.round(x.double() / d.clamp_min(1e-300)), torch.zeros_like(d))
    y = (c @ q.double().T) * d * scale.double()
    return y if bias is None else y + bias.double()


def _cpu_has_vnni512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {f}" in flags for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni"))


def test_offered_exactly_where_the_cpu_has_the_tiles():
    off = os.environ.get("SUBQUAD_AMX") == "0"
    assert qgemv.amx() == (_cpu_has_amx() and qgemv.INT8_AMX.available() and not off)
    vectors = _cpu_has_vnni512() and qgemv.INT8_AMX.available() and not off
    assert qgemv.packed_int8() == (1 if qgemv.amx() else 2 if vectors else 0)


needs_amx = pytest.mark.skipif(not qgemv.packed_int8(),
                               reason="neither AMX tiles nor AVX-512 VNNI on this CPU (the test above checks that)")


@needs_amx
@pytest.mark.parametrize("M,N,K,bias", [(1, 3072, 768, False), (3, 77, 64, True), (16, 50, 128, True),
                                        (17, 33, 192, False), (40, 100, 64, True), (33, 16, 64, True),
                                        (64, 48, 128, False), (100, 96, 64, True)])
def test_against_its_math(M, N, K, bias):
    """Past 16 rows two channel blocks x two row tiles at a time (int8_amx_many): odd and even counts of each;
    a row's result the same bits as that row alone."""
    g = torch.Generator().manual_seed(M * 100 + N)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = torch.rand(N, generator=g) + 0.01
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K + 7, generator=g)[:, 3:K + 3]              # a row stride that is not K
    if M > 1:
        x[M // 2] = 0.0                                              # a zero row: scale 0, output the bias
    y = qgemv.int8_amx(x, q, scale, b, key=-(M * 100 + N))
    ref = _math(x, q, scale, b)
    assert y.shape == (M, N) and ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert torch.equal(y[-1], qgemv.int8_amx(x[-1:], q, scale, b, key=-(M * 100 + N))[0])


@needs_amx
def test_the_tiles_are_remade_when_q_changes_in_place():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (40, 128), dtype=torch.int8, generator=g)
    scale, x = torch.rand(40, generator=g) + 0.1, torch.randn(5, 128, generator=g)
    first = qgemv.int8_amx(x, q, scale, None, key=-1)
    q[3].neg_()
    again = qgemv.int8_amx(x, q, scale, None, key=-1)
    ref = _math(x, q, scale, None)
    assert (again - first).abs().max() > 0 and ((again.double() - ref).abs().max() / ref.abs().max()) < 1e-6


@needs_amx
def test_the_modules_and_a_mamba_block_take_them_for_a_few_rows(monkeypatch):
    from subquad.layers.mamba import kernel_weight

    lin = Int8Linear(torch.randn(96, 128) * 0.05, torch.randn(96))
    calls, real = [], type(qgemv.INT8_AMX).__call__
    monkeypatch.setattr(type(qgemv.INT8_AMX), "__call__", lambda s, *a: (calls.append(s.name), real(s, *a))[1])
    packed = bool(qgemv.packed_int8())                  # then at every row count: one rounding whatever the rows
    for rows, taken in ((1, packed), (2, packed), (3, packed), (16, packed), (17, packed), (200, packed)):
        calls.clear()
        x = torch.randn(rows, 128)
        with torch.no_grad():
            y = lin(x)
        assert ("int8_amx_gemv" in calls) == taken, rows
        if taken:
            assert ((y.double() - _math(x, lin.q, lin.scale, lin.bias)).abs().max() < 1e-5 * y.abs().max())
    calls.clear()
    with torch.no_grad(), decoding():                    # a decoding batch past 16 rows: 16 rows at a time
        x = torch.randn(40, 128)
        y = lin(x)
    assert ("int8_amx_gemv" in calls) == packed
    if packed:
        assert (y.double() - _math(x, lin.q, lin.scale, lin.bias)).abs().max() < 1e-5 * y.abs().max()
        assert qgemv.block_int8q_rows() == 0                     # a Mamba block's one call takes them at 1 row too
        assert kernel_weight(lin, 1)[2] == 9 and kernel_weight(lin, 16)[2] == 9
        odd = Int8Linear(torch.randn(96, 72) * 0.05)             # a width padded to 64's multiple: the same sums
        x = torch.randn(3, 72)
        with torch.no_grad():
            assert (odd(x).double() - _math(x, odd.q, odd.scale, None)).abs().max() < 1e-5 * odd(x).abs().max()
    else:
        assert qgemv.block_int8q_rows() == qgemv.BLOCK_INT8Q_ROWS
        assert kernel_weight(lin, qgemv.BLOCK_INT8Q_ROWS)[2] == 2


def test_off_in_the_environment(monkeypatch):
    monkeypatch.setenv("SUBQUAD_AMX", "0")
    qgemv.packed_int8.cache_clear()
    try:
        assert not qgemv.amx() and not qgemv.packed_int8()
    finally:
        monkeypatch.delenv("SUBQUAD_AMX")
        qgemv.packed_int8.cache_clear()


@needs_amx
def test_a_kept_mlp_call_reads_the_tiles_and_sees_its_weights_edited_in_place():
    """An int8 SwiGLU block's MLP at 16 rows runs as one call reading the tiles (``layers.mlp_step``, kept between
    tokens: the tiles are not a module's tensor, ``kernels.derive`` ties them to q); q edited in place: the next
    call reads new tiles. Each against the modules' forward within 1% of its scale (x rounded to 8 bits is a step
    function: the two paths' norms may differ in a last bit and move one code, as in fused_harness)."""
    from subquad.layers import mlp_step
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=1, pattern="mamba2", mlp=True, mlp_size=128,
                                  mlp_kind="swiglu")).eval()
    quantize(m, "int8", min_weights=0)
    blk, h = m.blocks[0], torch.randn(16, 1, 64)

    def both():                                          # the MLP's part of h' (the residual h dwarfs it)
        got = mlp_step.fused_mlp(blk.mlp, h, blk.norm2)
        return None if got is None else got - h, blk.mlp(blk.norm2(h))

    with torch.no_grad():
        got, want = both()
        assert got is not None and (got - want).abs().max() < 1e-2 * want.abs().max()
        assert mlp_step.kept(blk.mlp, blk.norm2, h)[1].call is mlp_step.kept(blk.mlp, blk.norm2, h)[1].call
        blk.mlp.w_up.q[:7].neg_()
        got2, want2 = both()
        assert (want2 - want).abs().max() > 0.05 * want.abs().max()
        assert (got2 - want2).abs().max() < 1e-2 * want2.abs().max()
