"""Mamba-2's SSD with B and C shared by the heads (the Mamba2 layer's chunk mode, with and without a
gradient) equals simple_gla with q = C and k = dt B copied to every head."""

import pytest
import torch

from subquad.ops import simple_gla
from subquad.ops.gla.ssd import ssd_chunkwise, ssd_inference
from tests.ops.harness import assert_close

F64 = torch.float64


@pytest.mark.parametrize("T,C,group", [(1, 64, None), (7, 16, None), (100, 16, 32), (257, 5, 10), (300, 64, None)])
@pytest.mark.parametrize("strength", [0.01, 1.0, 30.0])
def test_ssd_equals_simple_gla(T, C, group, strength):
    gen = torch.Generator().manual_seed(T)
    Bz, H, P, N = 2, 3, 4, 5
    x = torch.randn(Bz, T, H, P, generator=gen, dtype=F64)
    dt = torch.rand(Bz, T, H, generator=gen, dtype=F64) * strength
    A = -torch.rand(H, generator=gen, dtype=F64) - 0.1
    Bm, Cm = (torch.randn(Bz, T, N, generator=gen, dtype=F64) for _ in range(2))
    S0 = torch.randn(Bz, H, N, P, generator=gen, dtype=F64)
    y, S = ssd_inference(x, dt, A, Bm, Cm, chunk_size=C, initial_state=S0, group=group)
    q, k = Cm.unsqueeze(2).expand(-1, -1, H, -1), Bm.unsqueeze(2).expand(-1, -1, H, -1) * dt.unsqueeze(-1)
    y_ref, S_ref = simple_gla(q, k, x, dt * A, mode="parallel", scale=1.0, initial_state=S0, output_final_state=True)
    assert_close(y, y_ref, 1e-10, "y")
    assert_close(S, S_ref, 1e-10, "state")


def test_ssd_strong_decays_long_sequence_stay_finite():
    gen = torch.Generator().manual_seed(0)
    T, H, P, N = 65536, 2, 4, 4
    x = torch.randn(1, T, H, P, generator=gen)
    dt = 50 * torch.rand(1, T, H, generator=gen)
    Bm, Cm = (torch.randn(1, T, N, generator=gen) for _ in range(2))
    y, S = ssd_inference(x, dt, -torch.ones(H), Bm, Cm)
    assert torch.isfinite(y).all() and torch.isfinite(S).all()


@pytest.mark.parametrize("T,C", [(1, 64), (7, 16), (100, 16), (257, 5)])
@pytest.mark.parametrize("strength", [0.01, 1.0, 30.0])
def test_differentiable_ssd_equals_simple_gla_with_gradients(T, C, strength):
    gen = torch.Generator().manual_seed(T)
    Bz, H, P, N = 2, 3, 4, 5

    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).requires_grad_()

    x, Bm, Cm, S0 = mk(Bz, T, H, P), mk(Bz, T, N), mk(Bz, T, N), mk(Bz, H, N, P)
    dt = (torch.rand(Bz, T, H, generator=gen, dtype=F64) * strength).requires_grad_()
    A = (-torch.rand(H, generator=gen, dtype=F64) - 0.1).requires_grad_()
    y, S = ssd_chunkwise(x, dt, A, Bm, Cm, chunk_size=C, initial_state=S0)
    q, k = Cm.unsqueeze(2).expand(-1, -1, H, -1), Bm.unsqueeze(2).expand(-1, -1, H, -1) * dt.unsqueeze(-1)
    y_ref, S_ref = simple_gla(q, k, x, dt * A, mode="parallel", scale=1.0, initial_state=S0, output_final_state=True)
    assert_close(y, y_ref, 1e-10, "y")
    assert_close(S, S_ref, 1e-10, "state")
    dy, dS = torch.randn(y.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    wrt = (x, dt, A, Bm, Cm, S0)
    for name, a, b in zip("x dt A B C S0".split(), torch.autograd.grad((y * dy).sum() + (S * dS).sum(), wrt),
                          torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), wrt)):
        assert_close(a, b, 1e-10, f"d{name}")
