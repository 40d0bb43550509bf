"""delta_rule and gated_delta_rule: the shared three-form battery, stability and bad input."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from subquad.ops import delta_rule, gated_delta_rule
from subquad.ops.common.routes import reset_routes, routes_taken
from subquad.ops.delta.chunk import chunk_delta
from subquad.ops.delta.triangular import unit_lower_inverse, unit_lower_solve

delta_chunk = importlib.import_module("subquad.ops.delta.chunk")
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(gated, B, T, H=2, K=5, V=3, seed=0, strength=1.0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    x = {"q": q, "k": k, "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
         "beta": torch.rand(B, T, H, generator=gen, dtype=dtype)}
    if gated:
        x["g"] = -strength * torch.rand(B, T, H, generator=gen, dtype=dtype)
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    return torch.randn(B, H, K, x["v"].shape[-1], generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def call(mode, x, chunk_size, initial_state, out):
    if "g" in x:
        return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode, chunk_size=chunk_size,
                                initial_state=initial_state, output_final_state=out)
    return delta_rule(x["q"], x["k"], x["v"], x["beta"], mode=mode, chunk_size=chunk_size,
                      initial_state=initial_state, output_final_state=out)


GATED = pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])


@GATED
@pytest.mark.parametrize("T", [1, 7, 64, 100, 257])
def test_forms_agree_with_the_token_loop(gated, T):
    x = make(gated, 2, T, seed=T)
    for C in (16, 64):
        check_forms_agree(call, x, C, initial_state=state0(x), ref="recurrent")


@GATED
@given(B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 3), K=st.integers(1, 8), V=st.integers(1, 8),
       C=st.integers(1, 40), strength=st.sampled_from([0.01, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_forms_agree_property(gated, B, T, H, K, V, C, strength, seed):
    x = make(gated, B, T, H, K, V, seed=seed, strength=strength)
    check_forms_agree(call, x, C, initial_state=state0(x, seed), ref="recurrent")


@GATED
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(gated, mode):
    x = make(gated, 2, 53, seed=4)
    check_split(call, x, 20, chunk_size=16, mode=mode, seq_keys=tuple(x))


@GATED
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (64, 32)])
def test_gradients_of_q_k_v_beta_g_and_initial_state_agree(gated, T, C):
    x = make(gated, 2, T, K=4, V=6, seed=T, strength=2.0)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")


@GATED
@pytest.mark.parametrize("T,C,group", [(1, 64, None), (7, 16, None), (100, 16, 32), (257, 5, 10), (300, 64, None)])
@pytest.mark.parametrize("strength", [0.01, 1.0, 50.0])
def test_no_grad_fast_path_agrees_with_the_token_loop(gated, T, C, group, strength):
    # Without a gradient the chunk engine writes its temporaries into buffers reused from group to group:
    # groups of chunks, one triangular solve per group, each chunk an affine map of the state in the loop.
    x = {n: t.detach() for n, t in make(gated, 2, T, K=6, V=4, seed=T, strength=strength).items()}
    S0 = state0(x).detach()
    o_ref, s_ref = call("recurrent", x, C, S0, True)
    o, s = chunk_delta(x["q"], x["k"], x["v"], x.get("g"), x["beta"], scale=6 ** -0.5, chunk_size=C,
                       initial_state=S0, group=group)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(s, s_ref, 1e-10, "state")
    with torch.no_grad():                                   # and the public op takes this path
        o2, s2 = call("chunk", x, C, S0, True)
    assert_close(o2, o_ref, 1e-10, "op under no_grad: o")
    assert_close(s2, s_ref, 1e-10, "op under no_grad: state")


@GATED
def test_float32_long_sequence_chunk_matches_recurrent(gated):
    x = {n: t.detach().float() for n, t in make(gated, 1, 4096, H=2, K=16, V=16, strength=0.1).items()}
    o_c, s_c = call("chunk", x, 64, None, True)
    o_r, s_r = call("recurrent", x, 64, None, True)
    assert_close(o_c, o_r, 1e-4, "o")
    assert_close(s_c, s_r, 1e-4, "state")


@GATED
def test_stable_with_beta_one_strong_decays_and_long_sequences(gated):
    # beta up to 1, log-decays down to -50, T = 65,536, float32: finite forward and backward.
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 65536, 1, 8, 8
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen)
    beta[:, ::7] = 1.0
    beta.requires_grad_()
    x = {"q": q, "k": k, "v": v, "beta": beta}
    if gated:
        x["g"] = (-50 * torch.rand(B, T, H, generator=gen)).requires_grad_()
    o, S = call("chunk", x, 64, None, True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    grads = torch.autograd.grad(o.square().mean() + S.square().mean(), list(x.values()))
    assert all(torch.isfinite(t).all() for t in grads)
    with torch.no_grad():                                   # the no-gradient fast path
        o_ng, S = call("chunk", x, 64, None, True)
    assert torch.isfinite(o_ng).all() and torch.isfinite(S).all()
    # and right, not only finite: the first 2,048 tokens against the float64 token loop
    p = 2048
    ref, _ = call("recurrent", {n: t[:, :p].detach().double() for n, t in x.items()}, 64, None, True)
    assert_close(o[:, :p].detach().double(), ref, 1e-4, "strong decays, with a gradient")
    assert_close(o_ng[:, :p].double(), ref, 1e-4, "strong decays, without a gradient")


@GATED
def test_unnormalised_keys_of_norm_ten_stay_finite_where_the_math_does(gated):
    # |k| = 10 with beta = 0.02 keeps b |k|^2 = 2, the edge of stability: every form is finite and agrees.
    x = make(gated, 1, 300, K=6, V=4, seed=3)
    x = {n: t.detach() for n, t in x.items()}
    x["k"] = x["k"] * 10
    x["beta"] = torch.full_like(x["beta"], 0.02)
    o_r, _ = call("recurrent", x, 32, None, True)
    o_c, _ = call("chunk", x, 32, None, True)
    assert torch.isfinite(o_c).all()
    assert_close(o_c, o_r, 1e-8, "norm-10 keys")


def test_bad_input_raises():
    x = {n: t.detach() for n, t in make(True, 1, 8).items()}
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["g"]
    with pytest.raises(ValueError, match="beta is the write strength"):
        delta_rule(q, k, v, beta + 1.5)
    with pytest.raises(ValueError, match="beta must have shape"):
        delta_rule(q, k, v, beta[..., :1])
    with pytest.raises(ValueError, match="g is a log-decay"):
        gated_delta_rule(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule(q, k, v, beta, chunk_size=-1)
    with pytest.raises(ValueError, match="mode"):
        delta_rule(q, k, v, beta, mode="wy")


@pytest.mark.parametrize("C", [1, 5, 16, 17, 32, 64, 100])
def test_unit_lower_inverse_equals_the_inverse(C):
    gen = torch.Generator().manual_seed(C)
    A = torch.eye(C, dtype=F64) + torch.randn(3, C, C, generator=gen, dtype=F64).tril(-1) * 0.3
    assert_close(unit_lower_inverse(A), torch.linalg.inv(A), 1e-10, f"C={C}")


@GATED
def test_long_differentiable_calls_run_in_groups_with_the_same_values_and_gradients(gated, monkeypatch):
    # A call longer than a group (TOKEN_HEADS (token, head) pairs) runs group by group with the state carried.
    monkeypatch.setattr(delta_chunk, "TOKEN_HEADS", 4 * 32)           # B H = 4: groups of 32 tokens
    x = make(gated, 2, 100, K=4, V=6, seed=5, strength=2.0)
    check_grads_agree(call, x, 16, state0(x), ref="recurrent")
    check_forms_agree(call, x, 16, initial_state=state0(x), ref="recurrent")


def test_unit_lower_solve_and_its_gradient_equal_linalg():
    gen = torch.Generator().manual_seed(0)
    L = (torch.randn(2, 3, 37, 37, generator=gen, dtype=F64).tril(-1) * 0.3).requires_grad_()
    R = torch.randn(2, 3, 37, 5, generator=gen, dtype=F64).requires_grad_()
    dX = torch.randn(2, 3, 37, 5, generator=gen, dtype=F64)
    eye = torch.eye(37, dtype=F64)
    X, = unit_lower_solve(eye + L, R)
    ref = torch.linalg.solve_triangular(eye + L, R, upper=False, unitriangular=True)
    assert_close(X, ref, 1e-10, "X")
    for a, b in zip(torch.autograd.grad((X * dX).sum(), (L, R)), torch.autograd.grad((ref * dX).sum(), (L, R))):
        assert_close(a, b, 1e-10, "gradient")


ROUTE_CASES = [("token", 3), ("chunk", 3), ("chunk", 70), ("token", 70)]


@GATED
@pytest.mark.parametrize("route,T", ROUTE_CASES)
def test_each_route_forced_agrees_with_the_token_loop_values_and_gradients(gated, route, T):
    # route= forces the chunk form's route whatever T and grad mode; the route taken is recorded.
    x = make(gated, 2, T, K=4, V=6, seed=T, strength=2.0)
    S0 = state0(x)
    forced = lambda mode, x, C, S, out: (call_route(route, x, C, S, out) if mode == "chunk"
                                         else call(mode, x, C, S, out))
    reset_routes()
    check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    check_grads_agree(forced, x, 16, S0, modes=("chunk",), ref="recurrent")
    with torch.no_grad():
        check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    op = "gated_delta_rule" if gated else "delta_rule"
    assert routes_taken() == {(op, route): 3}                        # three chunk-form calls above


def call_route(route, x, chunk_size, initial_state, out):
    kw = dict(mode="chunk", chunk_size=chunk_size, initial_state=initial_state, output_final_state=out, route=route)
    if "g" in x:
        return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw)


@GATED
def test_automatic_route_takes_the_token_loop_only_for_short_calls_without_a_gradient(gated):
    op = "gated_delta_rule" if gated else "delta_rule"
    for T, grad, route in [(1, False, "token"), (3, False, "token"), (4, False, "chunk"), (1, True, "chunk"),
                           (70, True, "chunk"), (70, False, "chunk")]:
        x = make(gated, 1, T, seed=T)
        reset_routes()
        with torch.set_grad_enabled(grad):
            call("chunk", x, 16, None, False)
        assert routes_taken() == {(op, route): 1}, (T, grad, routes_taken())


def test_route_is_checked():
    x = {n: t.detach() for n, t in make(True, 1, 8).items()}
    with pytest.raises(ValueError, match=r"route must be None \(automatic\) or one of 'token', 'chunk'"):
        delta_rule(x["q"], x["k"], x["v"], x["beta"], route="inference")
    with pytest.raises(ValueError, match="route chooses between the chunk form's routes"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode="recurrent", route="token")


@GATED
@pytest.mark.parametrize("T,C,group", [(37, 16, 16), (100, 5, 10), (300, 64, None)])
def test_the_engine_with_and_without_a_gradient_gives_the_same_values(gated, T, C, group):
    # One engine: with a gradient autograd records every op; without one the same lines write into reused
    # buffers and skip the Functions. Both equal the token loop; the gradients come from the first.
    x = make(gated, 2, T, K=6, V=4, seed=T, strength=1.0)
    S0 = state0(x)
    args = (x["q"], x["k"], x["v"], x.get("g"), x["beta"])
    o_ref, s_ref = call("recurrent", x, C, S0, True)
    o, s = chunk_delta(*args, scale=6 ** -0.5, chunk_size=C, initial_state=S0, group=group)
    assert o.requires_grad
    with torch.no_grad():
        o_ng, s_ng = chunk_delta(*args, scale=6 ** -0.5, chunk_size=C, initial_state=S0, group=group)
    for a, b, what in [(o, o_ref, "o"), (s, s_ref, "state"), (o_ng, o_ref, "o, no gradient"),
                       (s_ng, s_ref, "state, no gradient")]:
        assert_close(a.detach(), b.detach(), 1e-10, what)
