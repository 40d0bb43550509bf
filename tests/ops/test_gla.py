"""retention, simple_gla and gla: the shared three-form battery plus decay-specific cases."""

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from subquad.ops import gla, retention, simple_gla
from subquad.ops.common.routes import reset_routes, routes_taken
from subquad.ops.decay.chunk import chunk_engine
from subquad.ops.decay.parallel import parallel_decay_attention

gla_chunk = importlib.import_module("subquad.ops.decay.chunk")
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64
OPS = {"retention": retention, "simple_gla": simple_gla, "gla": gla}


def gate_shape(name, B, T, H, K):
    return {"retention": (H,), "simple_gla": (B, T, H), "gla": (B, T, H, K)}[name]


def make(name, B, T, H=2, K=5, V=3, seed=0, strength=1.0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -strength * torch.rand(gate_shape(name, B, T, H, K), generator=gen, dtype=dtype)
    return {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(), "g": g.requires_grad_()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    return torch.randn(B, H, K, x["v"].shape[-1], generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def caller(name):
    def call(mode, x, chunk_size, initial_state, out):
        return OPS[name](x["q"], x["k"], x["v"], x["g"], mode=mode, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=out)
    return call


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T", [1, 7, 64, 100, 257])
def test_forms_agree_fixed_lengths(name, T):
    x = make(name, 2, T, seed=T)
    for C in (16, 64):
        check_forms_agree(caller(name), x, C, initial_state=state0(x))


@pytest.mark.parametrize("name", OPS)
@given(B=st.integers(1, 2), T=st.integers(1, 80), H=st.integers(1, 3), K=st.integers(1, 8), V=st.integers(1, 8),
       C=st.integers(1, 40), strength=st.sampled_from([0.01, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_forms_agree_property(name, B, T, H, K, V, C, strength, seed):
    x = make(name, B, T, H, K, V, seed=seed, strength=strength)
    check_forms_agree(caller(name), x, C, initial_state=state0(x, seed))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(name, mode):
    x = make(name, 2, 61, seed=3)
    seq = ("q", "k", "v") if name == "retention" else ("q", "k", "v", "g")
    check_split(caller(name), x, 23, chunk_size=16, mode=mode, seq_keys=seq)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (64, 32)])
def test_gradients_agree_including_g_and_initial_state(name, T, C):
    x = make(name, 2, T, K=4, V=6, seed=T, strength=2.0)
    check_grads_agree(caller(name), x, C, state0(x))


@pytest.mark.parametrize("name", OPS)
def test_float32_long_sequence_chunk_matches_recurrent(name):
    x = {n: t.detach().float() for n, t in make(name, 1, 4096, H=2, K=16, V=16, strength=0.2).items()}
    o_c, s_c = OPS[name](x["q"], x["k"], x["v"], x["g"], mode="chunk", output_final_state=True)
    o_r, s_r = OPS[name](x["q"], x["k"], x["v"], x["g"], mode="recurrent", output_final_state=True)
    assert_close(o_c, o_r, 1e-4, f"{name} float32 T=4096 o")
    assert_close(s_c, s_r, 1e-4, f"{name} float32 T=4096 state")


@pytest.mark.parametrize("name", OPS)
def test_strong_decays_long_sequence_stay_finite(name):
    # log-decays from -50 to 0 per token over T = 65,536 in float32: no inf or NaN, forward or backward.
    B, T, H, K, V = 1, 65536, 1, 8, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, generator=gen).requires_grad_() for d in (K, K, V))
    g = (-50 * torch.rand(gate_shape(name, B, T, H, K), generator=gen)).requires_grad_()
    for mode in ("chunk",):
        o, S = OPS[name](q, k, v, g, mode=mode, chunk_size=64, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(S).all(), mode
        grads = torch.autograd.grad(o.square().mean() + S.square().mean(), (q, k, v, g))
        assert all(torch.isfinite(t).all() for t in grads), mode
        with torch.no_grad():                               # the no-gradient fast path
            o_ng, S = OPS[name](q, k, v, g, mode=mode, chunk_size=64, output_final_state=True)
        assert torch.isfinite(o_ng).all() and torch.isfinite(S).all(), f"{mode} without a gradient"
        # and right, not only finite: the first 2,048 tokens against the float64 token loop
        p = 2048
        ref, _ = OPS[name](*(t[:, :p].detach().double() for t in (q, k, v)),
                           (g if name == "retention" else g[:, :p]).detach().double(), mode="recurrent")
        assert_close(o[:, :p].detach().double(), ref, 1e-4, f"{name} strong decays, with a gradient")
        assert_close(o_ng[:, :p].double(), ref, 1e-4, f"{name} strong decays, without a gradient")
    # parallel and recurrent on a shorter stretch of the same strong decays
    s = 1024
    gs = g[:, :s] if name != "retention" else g
    for mode in ("parallel", "recurrent"):
        o, S = OPS[name](q[:, :s], k[:, :s], v[:, :s], gs, mode=mode, output_final_state=True)
        grads = torch.autograd.grad(o.square().mean() + S.square().mean(), (q, k, v, g))
        assert torch.isfinite(o).all() and all(torch.isfinite(t).all() for t in grads), mode


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T,C,group", [(1, 64, None), (7, 16, None), (100, 16, 32), (257, 5, 10), (300, 64, None)])
@pytest.mark.parametrize("strength", [0.01, 1.0, 50.0, "mixed"])
def test_no_grad_fast_path_agrees(name, T, C, group, strength):
    # Without a gradient the chunk engine runs groups of chunks, factorised scores where every chunk decays
    # by at most FACTOR_LIMIT, the exact route elsewhere ("mixed": weak decays, then strong ones).
    x = {n: t.detach() for n, t in make(name, 2, T, K=6, V=4, seed=T, strength=1.0).items()}
    if strength == "mixed":
        g = x["g"].clone()
        if name != "retention":
            g[:, T // 2:] *= 50.0
        else:
            g[0] *= 50.0
    else:
        g = x["g"] * strength
    x["g"] = g
    S0 = state0(x).detach()
    gt = g if name != "retention" else g.view(1, 1, -1).expand(2, T, -1)       # the ops' (B, T, H[, K]) layout
    o, s = chunk_engine(x["q"], x["k"], x["v"], gt, scale=0.3, chunk_size=C, initial_state=S0, group=group)
    o_ref, s_ref = parallel_decay_attention(x["q"], x["k"], x["v"], gt, scale=0.3, initial_state=S0)
    assert_close(o, o_ref, 1e-10, "no-grad o")
    assert_close(s, s_ref, 1e-10, "no-grad state")
    with torch.no_grad():                                   # and the public op takes this path
        o2, s2 = caller(name)("chunk", x, C, S0, True)
    o_ref2, s_ref2 = caller(name)("parallel", x, C, S0, True)
    assert_close(o2, o_ref2, 1e-10, "op under no_grad: o")
    assert_close(s2, s_ref2, 1e-10, "op under no_grad: state")


def test_simple_gla_is_the_mamba2_recurrence():
    # k = B_t dt_t, v = x_t, q = C_t, g = dt_t A: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t
    gen = torch.Generator().manual_seed(0)
    Bn, T, H, N, P = 2, 40, 3, 6, 4
    x = torch.randn(Bn, T, H, P, generator=gen, dtype=F64)
    Bm, Cm = (torch.randn(Bn, T, H, N, generator=gen, dtype=F64) for _ in range(2))
    dt = torch.rand(Bn, T, H, generator=gen, dtype=F64) + 0.1
    A = -torch.rand(H, generator=gen, dtype=F64) - 0.5
    y, _ = simple_gla(Cm, Bm * dt[..., None], x, dt * A, mode="chunk", chunk_size=16, scale=1.0)
    h = torch.zeros(Bn, H, N, P, dtype=F64)
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + (dt[:, t, :, None] * Bm[:, t])[..., None] * x[:, t, :, None, :]
        ys.append(torch.einsum("bhn,bhnp->bhp", Cm[:, t], h))
    assert_close(y, torch.stack(ys, 1), 1e-12, "SSD vs Mamba-2 loop")


@pytest.mark.parametrize("name", OPS)
def test_positive_gate_and_bad_shapes_raise(name):
    x = {n: t.detach() for n, t in make(name, 1, 8).items()}
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with pytest.raises(ValueError, match="g is a log-decay"):
        OPS[name](q, k, v, g + 1.0)
    with pytest.raises(ValueError, match="g must have shape"):
        OPS[name](q, k, v, g[..., :1] if name != "retention" else g[:1])
    with pytest.raises(ValueError, match="chunk_size"):
        OPS[name](q, k, v, g, chunk_size=0)
    with pytest.raises(ValueError, match="mode"):
        OPS[name](q, k, v, g, mode="scan")
    with pytest.raises(ValueError, match="initial_state"):
        OPS[name](q, k, v, g, initial_state=torch.zeros(1, 2, 3, 3, dtype=F64))


@pytest.mark.parametrize("name", OPS)
def test_long_differentiable_calls_run_in_groups_with_the_same_values_and_gradients(name, monkeypatch):
    # A call longer than a group runs group by group with the state (and in the backward its gradient) carried.
    monkeypatch.setattr(gla_chunk, "TOKEN_HEADS_DECAY", 32 * 4)      # B H = 4: groups of 32 tokens
    x = make(name, 2, 100, K=4, V=6, seed=5, strength=2.0)
    check_grads_agree(caller(name), x, 16, state0(x))
    check_forms_agree(caller(name), x, 16, initial_state=state0(x))


def route_caller(name, route):
    """The op with ``route`` forced in its chunk form (the other forms take none)."""
    def call(mode, x, chunk_size, initial_state, out):
        chosen = {"route": route} if mode == "chunk" else {}
        return OPS[name](x["q"], x["k"], x["v"], x["g"], mode=mode, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=out, **chosen)
    return call


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("route,strength", [("token", 1.0), ("token", 50.0), ("exact", 1.0), ("exact", 50.0),
                                            ("factorised", 1.0)])
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (100, 32)])
def test_each_route_forced_agrees_with_the_parallel_form_gradients_included(name, route, strength, T, C):
    # The chunk engine's hand-written backward (and the token loop's autograd) against the parallel form's
    # autograd in float64: o, the final state and the gradients of q, k, v, g and the initial state, at
    # g = -50 per token too (factors e^-800 in a chunk) - except the factorised route, which takes exp(-b)
    # and is only ever chosen for chunks decaying by at most e^FACTOR_LIMIT.
    x = make(name, 2, T, K=4, V=6, seed=T, strength=strength)
    reset_routes()
    check_forms_agree(route_caller(name, route), x, C, initial_state=state0(x), modes=("chunk",))
    check_grads_agree(route_caller(name, route), x, C, state0(x), modes=("chunk",))
    assert routes_taken().get((name, route), 0) > 0
    assert {r for (op, r) in routes_taken() if op == name} == {route}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("route", ["factorised", "exact"])
def test_gradcheck_of_the_chunk_engine(name, route):
    # Finite differences (torch.autograd.gradcheck) on a small float64 call over three groups of chunks,
    # an odd length and an initial state; strong decays on the exact route.
    B, T, H, K, V = 2, 11, 2, 3, 2
    x = make(name, B, T, H, K, V, seed=4, strength=1.0 if route == "factorised" else 20.0)
    S0 = state0(x)

    def f(q, k, v, g, s):
        return OPS[name](q, k, v, g, chunk_size=2, initial_state=s, output_final_state=True, route=route)

    torch.autograd.gradcheck(f, (x["q"], x["k"], x["v"], x["g"], S0), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", OPS)
def test_automatic_routes_are_recorded(name):
    # Weak decays factorise, strong ones take the exact route, with a gradient or without; a short call
    # without a gradient takes the token loop.
    x = {n: t.detach() for n, t in make(name, 2, 64, K=4, V=3, seed=2, strength=0.1).items()}
    for g, want in ((x["g"], "factorised"), (x["g"] * 500, "exact")):
        for grad in (False, True):
            reset_routes()
            q, k, v, gg = (t.clone().requires_grad_(grad) for t in (x["q"], x["k"], x["v"], g))
            OPS[name](q, k, v, gg, chunk_size=16)
            assert routes_taken() == {(name, want): 1}, (grad, routes_taken())
    reset_routes()
    with torch.no_grad():
        OPS[name](x["q"][:, :3], x["k"][:, :3], x["v"][:, :3], x["g"] if name == "retention" else x["g"][:, :3])
    assert routes_taken() == {(name, "token"): 1}


@pytest.mark.parametrize("name", ["simple_gla", "gla"])
def test_a_call_mixing_weak_and_strong_decays_takes_both_routes_group_by_group(name, monkeypatch):
    monkeypatch.setattr(gla_chunk, "TOKEN_HEADS_DECAY", 32 * 4)      # B H = 4: groups of 32 tokens
    x = make(name, 2, 64, K=4, V=3, seed=2, strength=0.1)
    with torch.no_grad():
        x["g"][:, 32:] *= 500
    reset_routes()
    check_grads_agree(caller(name), x, 16, state0(x), modes=("chunk",))
    assert {r for (op, r) in routes_taken() if op == name} == {"factorised", "exact"}


@pytest.mark.parametrize("name", OPS)
def test_route_argument_is_checked(name):
    x = {n: t.detach() for n, t in make(name, 1, 8).items()}
    with pytest.raises(ValueError, match="route must be None"):
        OPS[name](x["q"], x["k"], x["v"], x["g"], route="fast")
    with pytest.raises(ValueError, match="route='exact' is a route of the chunk form"):
        OPS[name](x["q"], x["k"], x["v"], x["g"], mode="parallel", route="exact")
