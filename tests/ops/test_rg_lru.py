"""rg_lru (Griffin's RG-LRU): three forms against the token loop and against the recurrence written out here,
split sequences, gradients of every input, resets, packed sequences, precision, compile and bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from subquad.ops import rg_lru
from subquad.ops.common.routes import reset_routes, routes_taken
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(B, T, H=2, P=3, seed=0, strength=1.0, resets=0.0, dtype=F64):
    """x and g (B, T, H, P); g in [-strength, 0), with a share ``resets`` of tokens reset (g = -inf)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen, dtype=dtype)
    g = -strength * torch.rand(B, T, H, P, generator=gen, dtype=dtype).clamp_min(1e-3)
    g[torch.rand(B, T, H, P, generator=gen) < resets] = float("-inf")
    return {"x": x.requires_grad_(), "g": g.requires_grad_()}


def state0(x, seed=1):
    B, _, H, P = x["x"].shape
    return torch.randn(B, H, P, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def call(mode, x, chunk_size, initial_state, out):
    return rg_lru(x["x"], x["g"], mode=mode, chunk_size=chunk_size, initial_state=initial_state,
                  output_final_state=out)


def written_out(x, g, h0=None):
    """The recurrence token by token, channel by channel, in Python floats: the independent reference."""
    B, T, H, P = x.shape
    o, x = torch.empty(B, T, H, P, dtype=F64), x.detach()
    h = torch.zeros(B, H, P, dtype=F64) if h0 is None else h0.detach().clone()
    for b in range(B):
        for i in range(H):
            for p in range(P):
                s = float(h[b, i, p])
                for t in range(T):
                    a = torch.exp(g[b, t, i, p].detach()).item()
                    s = a * s + (1 - a * a) ** 0.5 * x[b, t, i, p].item()
                    o[b, t, i, p] = s
                h[b, i, p] = s
    return o, h


@pytest.mark.parametrize("resets", [0.0, 0.1])
def test_every_form_equals_the_recurrence_written_out(resets):
    x = make(2, 37, seed=5, resets=resets)
    h0 = state0(x)
    want_o, want_h = written_out(x["x"], x["g"], h0)
    for mode in ("parallel", "recurrent", "chunk"):
        o, h = call(mode, x, 8, h0, True)
        assert_close(o, want_o, 1e-12, f"{mode}: o")
        assert_close(h, want_h, 1e-12, f"{mode}: final state")


def test_a_reset_forgets_the_past_and_writes_the_input_whole():
    x = make(1, 6, seed=2)
    g = x["g"].detach().clone()
    g[:, 3] = float("-inf")
    for mode in ("parallel", "recurrent", "chunk"):
        o, _ = rg_lru(x["x"].detach(), g, mode=mode, initial_state=torch.randn(1, 2, 3, dtype=F64))
        assert torch.equal(o[:, 3], x["x"].detach()[:, 3]), mode


@pytest.mark.parametrize("T", [1, 7, 64, 100, 257])
def test_forms_agree_with_the_token_loop(T):
    x = make(2, T, seed=T, resets=0.02)
    for C in (16, 64):
        check_forms_agree(call, x, C, initial_state=state0(x), ref="recurrent")


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 3), P=st.integers(1, 5), C=st.integers(1, 40),
       strength=st.sampled_from([0.001, 1.0, 50.0]), resets=st.sampled_from([0.0, 0.2]), seed=st.integers(0, 2**16))
def test_forms_agree_property(B, T, H, P, C, strength, resets, seed):
    x = make(B, T, H, P, seed=seed, strength=strength, resets=resets)
    check_forms_agree(call, x, C, initial_state=state0(x, seed), ref="recurrent")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(mode):
    x = make(2, 53, seed=4)
    check_split(call, x, 20, chunk_size=16, mode=mode, seq_keys=("x", "g"))


@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (64, 32), (129, 64)])
def test_gradients_of_x_g_and_initial_state_agree(T, C):
    x = make(2, T, seed=T, strength=3.0, resets=0.05)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_gradcheck(mode):
    x = make(1, 11, H=1, P=2, seed=3, strength=2.0)
    h0 = state0(x)
    torch.autograd.gradcheck(lambda a, b, s: rg_lru(a, b, mode=mode, chunk_size=4, initial_state=s,
                                                    output_final_state=True), (x["x"], x["g"], h0))


def test_the_normaliser_gradient_is_clipped_near_no_decay():
    # d sqrt(1 - exp(2g)) / dg -> -inf as g -> 0; Griffin clips d sqrt(y) / dy at 1000
    x = torch.ones(1, 1, 1, 3, dtype=F64)
    g = torch.tensor([-1e-12, -1e-3, -1.0], dtype=F64).view(1, 1, 1, 3).requires_grad_()
    o, _ = rg_lru(x, g, mode="recurrent")
    (dg,) = torch.autograd.grad(o.sum(), g)
    y = -torch.expm1(2 * g.detach())
    exact = -torch.exp(2 * g.detach()) / y.sqrt()                          # the true derivative
    clipped = -2 * torch.exp(2 * g.detach()) * torch.minimum(1 / (2 * y.sqrt()), torch.tensor(1000.0, dtype=F64))
    assert_close(dg, clipped, 1e-12, "dg")
    assert_close(dg[..., 1:], exact[..., 1:], 1e-12, "dg away from the clip")


def test_long_sequence_and_strong_decays_stay_finite_and_right():
    # T = 65,536, float32, log-decays down to -50 with resets: finite forward and backward
    x = make(1, 65536, H=1, P=4, strength=50.0, resets=0.01, dtype=torch.float32)
    o, h = call("chunk", x, 64, None, True)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    grads = torch.autograd.grad(o.square().mean() + h.square().mean(), [x["x"], x["g"]])
    assert all(torch.isfinite(t).all() for t in grads)
    p = 2048                                          # and right: the first tokens against the float64 token loop
    ref, _ = rg_lru(x["x"][:, :p].detach().double(), x["g"][:, :p].detach().double(), mode="recurrent")
    assert_close(o[:, :p].detach().double(), ref, 1e-5, "strong decays")


def test_float32_chunk_matches_the_token_loop_weak_decays():
    x = {n: t.detach() for n, t in make(1, 4096, H=2, P=8, strength=0.01, dtype=torch.float32).items()}
    o_c, s_c = call("chunk", x, 64, None, True)
    o_r, s_r = call("recurrent", x, 64, None, True)
    assert_close(o_c, o_r, 1e-4, "o")
    assert_close(s_c, s_r, 1e-4, "state")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_packed_sequences_equal_separate_calls_with_gradients(mode):
    lengths = [5, 1, 17, 9, 17]
    x = make(1, sum(lengths), seed=7, resets=0.05)
    h0 = torch.randn(len(lengths), 2, 3, dtype=F64, requires_grad=True)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    o, h = rg_lru(x["x"], x["g"], mode=mode, chunk_size=4, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    w = torch.randn(o.shape, dtype=F64)
    got = torch.autograd.grad((o * w).sum() + h.sum(), [x["x"], x["g"], h0])
    parts, finals, s = [], [], 0
    for i, n in enumerate(lengths):
        oi, hi = rg_lru(x["x"][:, s:s + n], x["g"][:, s:s + n], mode=mode, chunk_size=4, initial_state=h0[i:i + 1],
                        output_final_state=True)
        parts.append(oi)
        finals.append(hi)
        s += n
    ref_o, ref_h = torch.cat(parts, 1), torch.cat(finals, 0)
    assert_close(o, ref_o, 1e-12, "o")
    assert_close(h, ref_h, 1e-12, "final states")
    want = torch.autograd.grad((ref_o * w).sum() + ref_h.sum(), [x["x"], x["g"], h0])
    for name, a, b in zip(("x", "g", "initial_state"), got, want):
        assert_close(a, b, 1e-12, f"d{name}")


def test_bf16_autocast_keeps_a_float32_state_and_stays_close():
    x = {n: t.detach().float() for n, t in make(2, 300, H=2, P=8, seed=9, strength=0.5, resets=0.01).items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, h = rg_lru(x["x"], x["g"], output_final_state=True)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    ref, ref_h = rg_lru(x["x"].bfloat16().double(), x["g"].double(), mode="recurrent", output_final_state=True)
    assert_close(o.double(), ref, 2e-2, "o")                   # bf16 rounding of the output only
    assert_close(h.double(), ref_h, 1e-5, "state")              # the state is float32 throughout
    with pytest.raises(ValueError, match="initial_state must have the state's dtype"):
        rg_lru(x["x"].bfloat16(), x["g"], initial_state=h.bfloat16())


def test_torch_compile_equals_eager():
    x = {n: t.detach().float() for n, t in make(2, 45, seed=11, resets=0.05).items()}
    h0 = torch.randn(2, 2, 3)
    torch._dynamo.reset()
    compiled = torch.compile(rg_lru, backend="aot_eager")
    for mode in ("chunk", "recurrent"):
        o, h = compiled(x["x"], x["g"], mode=mode, chunk_size=16, initial_state=h0, output_final_state=True)
        ref_o, ref_h = rg_lru(x["x"], x["g"], mode=mode, chunk_size=16, initial_state=h0, output_final_state=True)
        assert_close(o, ref_o, 1e-6, f"{mode}: o")
        assert_close(h, ref_h, 1e-6, f"{mode}: state")


def test_routes_without_a_gradient_and_the_route_argument():
    x = {n: t.detach() for n, t in make(2, 100, seed=12).items()}
    h0 = state0(x).detach()
    ref_o, ref_h = call("recurrent", x, 16, h0, True)
    reset_routes()
    with torch.no_grad():
        for T, route in ((1, "token"), (100, "chunk")):
            o, h = rg_lru(x["x"][:, :T], x["g"][:, :T], initial_state=h0, output_final_state=True)
            assert_close(o, ref_o[:, :T], 1e-12, f"T={T}: o")
    assert routes_taken() == {("rg_lru", "token"): 1, ("rg_lru", "chunk"): 1}
    for route in ("token", "chunk"):
        o, h = rg_lru(x["x"], x["g"], initial_state=h0, output_final_state=True, route=route)
        assert_close(o, ref_o, 1e-12, f"route={route}: o")
        assert_close(h, ref_h, 1e-12, f"route={route}: state")


@pytest.mark.parametrize("T", [1, 17, 100, 257])
def test_the_in_place_chunk_path_without_a_gradient_equals_the_token_loop(T):
    x = {n: t.detach() for n, t in make(2, T, seed=T, strength=5.0, resets=0.05).items()}
    h0 = state0(x).detach()
    ref_o, ref_h = call("recurrent", x, 16, h0, True)
    with torch.no_grad():
        o, h = rg_lru(x["x"], x["g"], chunk_size=16, initial_state=h0, output_final_state=True, route="chunk")
    assert_close(o, ref_o, 1e-12, "o")
    assert_close(h, ref_h, 1e-12, "state")


def test_inputs_and_states_passed_in_are_not_modified():
    x = {n: t.detach() for n, t in make(1, 40, seed=13).items()}
    h0 = state0(x).detach()
    before = [t.clone() for t in (x["x"], x["g"], h0)]
    for mode in ("parallel", "recurrent", "chunk"):
        with torch.no_grad():
            rg_lru(x["x"], x["g"], mode=mode, initial_state=h0, output_final_state=True)
    assert all(torch.equal(a, b) for a, b in zip((x["x"], x["g"], h0), before))


def test_bad_input_raises_naming_the_argument():
    x = {n: t.detach() for n, t in make(1, 8).items()}
    xs, g = x["x"], x["g"]
    with pytest.raises(ValueError, match="g is a log-decay and must be <= 0"):
        rg_lru(xs, -g)
    with pytest.raises(ValueError, match="g must have shape"):
        rg_lru(xs, g[..., :2])
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor \(B, T, H, P\)"):
        rg_lru(xs.flatten(2), g.flatten(2))
    with pytest.raises(ValueError, match="x must hold at least one token"):
        rg_lru(xs[:, :0], g[:, :0])
    with pytest.raises(ValueError, match="mode"):
        rg_lru(xs, g, mode="scan")
    with pytest.raises(ValueError, match="chunk_size"):
        rg_lru(xs, g, chunk_size=0)
    with pytest.raises(ValueError, match="route"):
        rg_lru(xs, g, route="fast")
    with pytest.raises(ValueError, match="route chooses"):
        rg_lru(xs, g, mode="parallel", route="token")
    with pytest.raises(ValueError, match="output_final_state"):
        rg_lru(xs, g, output_final_state="yes")
    with pytest.raises(ValueError, match="initial_state"):
        rg_lru(xs, g, initial_state=torch.zeros(1, 2, 4, dtype=F64))
    with pytest.raises(ValueError, match="g must be float32, float64"):
        rg_lru(xs.float(), g.half())
    with pytest.raises(ValueError, match="cu_seqlens"):
        rg_lru(xs, g, cu_seqlens=torch.tensor([0, 3, 9]))
