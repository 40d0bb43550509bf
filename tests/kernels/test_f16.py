"""float16 weights times float32 rows in C (kernels/qgemv.c's f16_gemv: a GGUF file's F16 matrices, kept as the
file holds them) against the product of the widened matrix in float64: x exact, so the same product as the
dequantised matrix's up to float32 sums; 1-16 rows, channel counts with a last block of 4 cut short, K of one to
several vectors, a row stride that is not K, a zero row, with and without a bias. ``F16Linear`` takes it for 1-16
rows and the widened matrix beyond; the Mamba blocks' one calls are tested in ``tests/ops/fused_harness.py``."""

from __future__ import annotations

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models.quant import F16Linear

pytestmark = pytest.mark.skipif(not qgemv.F16.available(), reason="no C compiler: the kernel cannot be built")
needs_f16 = pytest.mark.skipif(not qgemv.f16(), reason="built without AVX2 + F16C")


@needs_f16
@pytest.mark.parametrize("N,K", [(5, 16), (16, 48), (37, 96), (67, 32)])
def test_the_product_against_its_math(N, K):
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).half()
    for rows in (1, 2, 3, 4, 5, 9, 16):
        for bias in (None, torch.randn(N, generator=g)):
            x = torch.randn(rows, K + 8, generator=g)[:, 3:3 + K]       # a row stride that is not K
            if rows > 1:
                x[rows // 2] = 0
            before = x.clone()
            y = qgemv.f16_gemv(x, w, bias)
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert y.dtype == torch.float32 and y.shape == (rows, N)
            assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6, (rows, bias is None)
            assert torch.equal(x, before)


@needs_f16
@pytest.mark.parametrize("N,K", [(37, 96), (67, 64)])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(N, K):
    """One channel at a time up to 2 rows, blocks of four beyond: each channel's sum is the same chain either way."""
    g = torch.Generator().manual_seed(N + K)
    w, bias = torch.randn(N, K, generator=g).half(), torch.randn(N, generator=g)
    x = torch.randn(16, K, generator=g)
    alone = torch.cat([qgemv.f16_gemv(x[i:i + 1], w, bias) for i in range(16)])
    for rows in (2, 3, 4, 5, 9, 16):
        assert torch.equal(qgemv.f16_gemv(x[:rows], w, bias), alone[:rows]), rows


@needs_f16
def test_the_module_takes_it_for_a_few_rows_and_the_widened_matrix_beyond(monkeypatch):
    lin = F16Linear(torch.randn(40, 64) * 0.1, torch.randn(40))
    assert lin.w.dtype == torch.float16 and lin.bias.dtype == torch.float32
    calls, real = [], type(qgemv.F16).__call__
    monkeypatch.setattr(type(qgemv.F16), "__call__", lambda s, *a: (calls.append(s.name), real(s, *a))[1])
    for rows, taken in ((1, True), (16, True), (17, False), (200, False)):
        calls.clear()
        x = torch.randn(rows, 64)
        with torch.no_grad():
            y = lin(x)
        assert ("f16_gemv" in calls) == taken, rows
        ref = x.double() @ lin.w.double().T + lin.bias.double()
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6, rows     # x exact either way
