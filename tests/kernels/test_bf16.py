"""bfloat16 products in C (kernels/qgemv.c's bf16_gemv) against their math in float64: x rounded to bfloat16 to
nearest even (as torch's ``.to(torch.bfloat16)``), exact products of bfloat16 pairs, float32 sums; through its
vectors and, where the CPU has them, its AMX-BF16 tiles; 1-16 rows, channel counts with a last block of 16 and of
4 cut short, K of 1-3 blocks of 32, a row stride that is not K, a zero row, with and without a bias. ``Bf16Linear``
takes it for 1-16 rows and torch's product beyond; a bfloat16 model's step is tested block by block in
``tests/ops/fused_harness.py``. On a CPU without AVX512-BF16 the kernel is never offered (``qgemv.bf16()`` 0)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models.quant import Bf16Linear

pytestmark = pytest.mark.skipif(not qgemv.BF16.available(), reason="no C compiler: the kernel cannot be built")
needs_bf16 = pytest.mark.skipif(not qgemv.bf16(), reason="this CPU has no AVX512-BF16")


def _flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def _math(x, w, bias):
    """The product as bf16_gemv defines it, in float64: x rounded to bfloat16, exact products and sums."""
    y = x.bfloat16().double() @ w.double().T
    return y if bias is None else y + bias.double()


def test_offered_exactly_where_the_cpu_has_it():
    flags, off = _flags(), os.environ.get("SUBQUAD_AMX") == "0"
    want = 0 if " avx512_bf16" not in flags else (2 if " amx_bf16" in flags and qgemv.amx() and not off else 1)
    assert qgemv.bf16() == want


@needs_bf16
@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("N,K", [(5, 32), (16, 64), (37, 96), (67, 32)])
def test_the_product_against_its_math(tiles, N, K):
    if tiles and qgemv.bf16() < 2:
        pytest.skip("this CPU has no AMX-BF16 tiles")
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).bfloat16()
    for rows in (1, 2, 3, 4, 5, 9, 16):
        for bias in (None, torch.randn(N, generator=g)):
            base = torch.randn(rows, K + 8, generator=g)
            x = base[:, 3:3 + K]                                 # a row stride that is not K
            if rows > 1:
                x[rows // 2] = 0                                 # a zero row
            before = x.clone()
            y = qgemv.bf16_gemv(x, w, bias, tiles)
            ref = _math(x, w, bias)
            assert y.dtype == torch.float32 and y.shape == (rows, N)
            assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6, (rows, bias is None)
            if rows > 1:
                assert torch.equal(y[rows // 2], torch.zeros(N) if bias is None else bias)
            assert torch.equal(x, before)                         # x read, never written


@needs_bf16
@pytest.mark.parametrize("N,K", [(37, 96), (67, 64)])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(N, K):
    """The vectors take one channel at a time up to 8 rows and blocks of four beyond; each channel's sum is the same
    chain either way, so a decoding row gives the same bits alone and in a batch of any size."""
    g = torch.Generator().manual_seed(N + K)
    w, bias = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g)
    x = torch.randn(16, K, generator=g)
    alone = torch.cat([qgemv.bf16_gemv(x[i:i + 1], w, bias, False) for i in range(16)])
    for rows in (2, 3, 4, 5, 8, 9, 12, 16):
        assert torch.equal(qgemv.bf16_gemv(x[:rows], w, bias, False), alone[:rows]), rows


@needs_bf16
def test_the_module_takes_it_for_a_few_rows_and_torch_beyond(monkeypatch):
    lin = Bf16Linear(torch.randn(40, 64) * 0.1, torch.randn(40))
    calls, real = [], type(qgemv.BF16).__call__
    monkeypatch.setattr(type(qgemv.BF16), "__call__", lambda s, *a: (calls.append(s.name), real(s, *a))[1])
    for rows, taken in ((1, True), (3, True), (16, True), (17, False), (200, False)):
        calls.clear()
        x = torch.randn(rows, 64)
        with torch.no_grad():
            y = lin(x)
        assert ("bf16_gemv" in calls) == taken, rows
        ref = _math(x, lin.w, lin.bias.float())
        # the kernel's y stays float32; torch's product rounds it to bfloat16 (2^-8 of its size)
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < (1e-6 if taken else 1e-2), rows
    with torch.no_grad():
        x = torch.randn(2, 64, requires_grad=True)
        calls.clear()
        lin(x)
        assert not calls                                          # a gradient wanted: torch's product
