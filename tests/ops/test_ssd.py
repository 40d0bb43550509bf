"""Mamba-2's SSD with B and C shared by the heads (the Mamba2 layer's chunk mode, with and without a
gradient, every route) equals simple_gla with q = C and k = dt B copied to every head."""

import importlib

import pytest
import torch

from subquad.ops import simple_gla, ssd
from subquad.ops.common.routes import reset_routes, routes_taken
from subquad.ops.decay.ssd import ssd_inference
from tests.ops.harness import assert_close

F64 = torch.float64


@pytest.mark.parametrize("T,C,group", [(1, 64, None), (7, 16, None), (100, 16, 32), (257, 5, 10), (300, 64, None)])
@pytest.mark.parametrize("strength", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("start", ["state", "zero"])
def test_ssd_equals_simple_gla(T, C, group, strength, start):
    """From a given state, and from none (the first chunk's terms that read the state are skipped: each route,
    one group or several, one chunk or more)."""
    gen = torch.Generator().manual_seed(T)
    Bz, H, P, N = 2, 3, 4, 5
    x = torch.randn(Bz, T, H, P, generator=gen, dtype=F64)
    dt = torch.rand(Bz, T, H, generator=gen, dtype=F64) * strength
    A = -torch.rand(H, generator=gen, dtype=F64) - 0.1
    Bm, Cm = (torch.randn(Bz, T, N, generator=gen, dtype=F64) for _ in range(2))
    S0 = torch.randn(Bz, H, N, P, generator=gen, dtype=F64) if start == "state" else None
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
    # and right, not only finite: the first 2,048 tokens against simple_gla's float64 token loop
    p = 2048
    xd, dtd, Bd, Cd = (t[:, :p].double() for t in (x, dt, Bm, Cm))
    q = Cd.unsqueeze(2).expand(-1, -1, H, -1)
    k = Bd.unsqueeze(2).expand(-1, -1, H, -1) * dtd.unsqueeze(-1)
    ref, _ = simple_gla(q, k, xd, -dtd, mode="recurrent", scale=1.0)
    # 1e-3, not 1e-4: at dt A down to -50 per token a chunk's cumulative log-decay reaches ~-1,600, whose
    # float32 spacing (1e-4) is the error of every exp(b_i - b_j) taken as a difference of two such sums
    assert_close(y[:, :p].double(), ref, 1e-3, "ssd strong decays")


@pytest.mark.parametrize("T,C", [(1, 64), (7, 16), (100, 16), (257, 5)])
# the factorised route is only ever chosen for chunks decaying by at most e^FACTOR_LIMIT: not forced past it
@pytest.mark.parametrize("strength,route", [(s, r) for s in (0.01, 1.0, 30.0)
                                            for r in (None, "token", "factorised", "exact")
                                            if not (r == "factorised" and s > 1.0)])
def test_ssd_equals_simple_gla_with_gradients_on_every_route(T, C, strength, route):
    # With a gradient: the chunk engine (B and C copied to every head) or the token loop; the same call
    # without a gradient: ssd_inference's shared products. Each route, forced, is recorded.
    gen = torch.Generator().manual_seed(T)
    Bz, H, P, N = 2, 3, 4, 5

    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).requires_grad_()

    x, Bm, Cm, S0 = mk(Bz, T, H, P), mk(Bz, T, N), mk(Bz, T, N), mk(Bz, H, N, P)
    dt = (torch.rand(Bz, T, H, generator=gen, dtype=F64) * strength).requires_grad_()
    A = (-torch.rand(H, generator=gen, dtype=F64) - 0.1).requires_grad_()
    reset_routes()
    y, S = ssd(x, dt, A, Bm, Cm, chunk_size=C, initial_state=S0, output_final_state=True, route=route)
    if route is not None:
        assert {r for (op, r) in routes_taken() if op == "ssd"} == {route}
    with torch.no_grad():
        y_ng, S_ng = ssd(x, dt, A, Bm, Cm, chunk_size=C, initial_state=S0, output_final_state=True, route=route)
    q, k = Cm.unsqueeze(2).expand(-1, -1, H, -1), Bm.unsqueeze(2).expand(-1, -1, H, -1) * dt.unsqueeze(-1)
    y_ref, S_ref = simple_gla(q, k, x, dt * A, mode="parallel", scale=1.0, initial_state=S0, output_final_state=True)
    assert_close(y, y_ref, 1e-10, "y")
    assert_close(S, S_ref, 1e-10, "state")
    assert_close(y_ng, y_ref, 1e-10, "y without a gradient")
    assert_close(S_ng, S_ref, 1e-10, "state without a gradient")
    dy, dS = torch.randn(y.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    wrt = (x, dt, A, Bm, Cm, S0)
    for name, a, b in zip("x dt A B C S0".split(), torch.autograd.grad((y * dy).sum() + (S * dS).sum(), wrt),
                          torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), wrt)):
        assert_close(a, b, 1e-10, f"d{name}")


@pytest.mark.parametrize("limit", [0.0, None, 1e9])
def test_ssd_routes_mixed_within_one_call(limit, monkeypatch):
    """Weak decays in one half (the factorised route), strong in the other (the exact route); LIMIT 0 forces
    the exact route everywhere, 1e9 the factorised route wherever float64 can hold it."""
    ssd = importlib.import_module("subquad.ops.decay.ssd")

    if limit is not None:
        monkeypatch.setattr(ssd, "LIMIT", limit)
    gen = torch.Generator().manual_seed(5)
    Bz, T, H, P, N = 2, 203, 3, 4, 5
    x = torch.randn(Bz, T, H, P, generator=gen, dtype=F64)
    strength = torch.where(torch.arange(T) < T // 2, 0.2, 40.0 if limit != 1e9 else 3.0).view(1, T, 1)
    dt = torch.rand(Bz, T, H, generator=gen, dtype=F64) * strength
    A = -torch.rand(H, generator=gen, dtype=F64) - 0.1
    Bm, Cm = (torch.randn(Bz, T, N, generator=gen, dtype=F64) for _ in range(2))
    S0 = torch.randn(Bz, H, N, P, generator=gen, dtype=F64)
    y, S = ssd_inference(x, dt, A, Bm, Cm, chunk_size=16, initial_state=S0, group=32)
    q, k = Cm.unsqueeze(2).expand(-1, -1, H, -1), Bm.unsqueeze(2).expand(-1, -1, H, -1) * dt.unsqueeze(-1)
    y_ref, S_ref = simple_gla(q, k, x, dt * A, mode="parallel", scale=1.0, initial_state=S0, output_final_state=True)
    assert_close(y, y_ref, 1e-10, "y")
    assert_close(S, S_ref, 1e-10, "state")


def test_ssd_factorised_route_float32_at_its_limit():
    """Chunks decaying by up to e^-2LIMIT (factors up to e^LIMIT) in float32 against float64."""
    ssd = importlib.import_module("subquad.ops.decay.ssd")

    gen = torch.Generator().manual_seed(6)
    T, H, P, N = 512, 4, 8, 8
    x = torch.randn(1, T, H, P, generator=gen, dtype=F64)
    dt = torch.full((1, T, H), 2 * ssd.LIMIT / 64 * 0.99, dtype=F64)   # every chunk of 64 decays by ~e^-59
    A = -torch.ones(H, dtype=F64)
    Bm, Cm = (torch.randn(1, T, N, generator=gen, dtype=F64) for _ in range(2))
    y64, S64 = ssd_inference(x, dt, A, Bm, Cm)
    y32, S32 = ssd_inference(*(t.float() for t in (x, dt, A, Bm, Cm)))
    assert torch.isfinite(y32).all()
    assert_close(y32.double(), y64, 1e-4, "y float32")
    assert_close(S32.double(), S64, 1e-4, "state float32")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_ssd_groups_equal_simple_gla_with_each_groups_b_and_c(mode):
    """n_groups: B and C (B, T, G, N), each shared by H / G consecutive heads - outputs, states and gradients
    equal simple_gla with q, k repeated per group (float64), with an initial state, odd length, strong decays."""
    g = torch.Generator().manual_seed(7)
    Bz, T, H, P, N, G = 2, 23, 6, 3, 5, 3
    x = torch.randn(Bz, T, H, P, generator=g, dtype=F64, requires_grad=True)
    dt = (torch.rand(Bz, T, H, generator=g, dtype=F64) * 3).requires_grad_(True)
    A = (-torch.rand(H, generator=g, dtype=F64) * 4).requires_grad_(True)
    Bm = torch.randn(Bz, T, G, N, generator=g, dtype=F64, requires_grad=True)
    Cm = torch.randn(Bz, T, G, N, generator=g, dtype=F64, requires_grad=True)
    h0 = torch.randn(Bz, H, N, P, generator=g, dtype=F64, requires_grad=True)
    y, h = ssd(x, dt, A, Bm, Cm, mode=mode, chunk_size=4, initial_state=h0, output_final_state=True)
    q, k = Cm.repeat_interleave(H // G, 2), Bm.repeat_interleave(H // G, 2) * dt.unsqueeze(-1)
    ref, S = simple_gla(q, k, x, dt * A, mode="recurrent", scale=1.0, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(h, S, rtol=0, atol=1e-10)
    w = torch.randn(y.shape, generator=g, dtype=F64)
    leaves = [x, dt, A, Bm, Cm, h0]
    ga = torch.autograd.grad((y * w).sum() + h.sum(), leaves)
    gb = torch.autograd.grad((ref * w).sum() + S.sum(), leaves)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="groups must divide"):
        four = torch.cat([Bm, Bm[:, :, :1]], 2).detach()              # 4 groups do not divide 6 heads
        ssd(x, dt, A, four, four)
