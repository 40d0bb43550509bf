"""selective_scan (Mamba-1): three forms, split sequences, gradients of every input, stability, bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from subquad.ops import selective_scan
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(B, T, Dm=6, N=4, seed=0, strength=1.0, gate=True, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = {"x": torch.randn(B, T, Dm, generator=g, dtype=dtype),
         "dt": torch.rand(B, T, Dm, generator=g, dtype=dtype) * strength,
         "A": -torch.rand(Dm, N, generator=g, dtype=dtype) - 0.5,
         "B": torch.randn(B, T, N, generator=g, dtype=dtype),
         "C": torch.randn(B, T, N, generator=g, dtype=dtype)}
    if gate:
        x["D"] = torch.randn(Dm, generator=g, dtype=dtype)
        x["z"] = torch.randn(B, T, Dm, generator=g, dtype=dtype)
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, Dm = x["x"].shape
    return torch.randn(B, Dm, x["A"].shape[1], generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def call(mode, x, chunk_size, initial_state, out):
    return selective_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], D=x.get("D"), z=x.get("z"), mode=mode,
                          chunk_size=chunk_size, initial_state=initial_state, output_final_state=out)


@pytest.mark.parametrize("T", [1, 7, 64, 100])
def test_forms_agree_with_the_token_loop(T):
    x = make(2, T, seed=T)
    for C in (16, 64):
        check_forms_agree(call, x, C, initial_state=state0(x), ref="recurrent")


@given(B=st.integers(1, 2), T=st.integers(1, 60), Dm=st.integers(1, 6), N=st.integers(1, 5), C=st.integers(1, 30),
       strength=st.sampled_from([0.01, 1.0, 10.0]), gate=st.booleans(), seed=st.integers(0, 2**16))
def test_forms_agree_property(B, T, Dm, N, C, strength, gate, seed):
    x = make(B, T, Dm, N, seed=seed, strength=strength, gate=gate)
    check_forms_agree(call, x, C, initial_state=state0(x, seed), ref="recurrent")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(mode):
    x = make(2, 47, seed=2)
    check_split(call, x, 19, chunk_size=8, mode=mode, seq_keys=("x", "dt", "B", "C", "z"))


@pytest.mark.parametrize("T,C", [(1, 8), (29, 8), (40, 16)])
def test_gradients_of_every_input_including_A_dt_and_initial_state(T, C):
    x = make(2, T, Dm=3, N=3, seed=T)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")


def test_float32_long_sequence_chunk_matches_recurrent():
    x = {n: t.detach().float() for n, t in make(1, 4096, Dm=8, N=4, strength=0.1).items()}
    y_c, h_c = call("chunk", x, 64, None, True)
    y_r, h_r = call("recurrent", x, 64, None, True)
    assert_close(y_c, y_r, 1e-4, "y")
    assert_close(h_c, h_r, 1e-4, "h")


def test_strong_decays_stay_finite():
    # dt * A down to -50 per token, float32, forward and backward
    x = {n: t.detach().float() for n, t in make(1, 8192, Dm=4, N=4, gate=False).items()}
    x["dt"] = torch.rand_like(x["dt"]) * 33            # A in [-1.5, -0.5]: dt * A reaches -50
    x = {n: t.requires_grad_() for n, t in x.items()}
    y, h = call("chunk", x, 64, None, True)
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    grads = torch.autograd.grad(y.square().mean() + h.square().mean(), list(x.values()))
    assert all(torch.isfinite(t).all() for t in grads)
    # and right, not only finite: the first 2,048 tokens against the float64 token loop
    p = 2048
    seq = {n: (t[:, :p] if t.dim() == 3 else t).detach().double() for n, t in x.items()}
    ref, _ = call("recurrent", seq, 64, None, True)
    assert_close(y[:, :p].detach().double(), ref, 1e-4, "strong decays")


def test_bad_input_raises():
    x = {n: t.detach() for n, t in make(1, 8).items()}
    with pytest.raises(ValueError, match="A must be <= 0"):
        selective_scan(x["x"], x["dt"], -x["A"], x["B"], x["C"])
    with pytest.raises(ValueError, match="dt must be >= 0"):
        selective_scan(x["x"], -x["dt"], x["A"], x["B"], x["C"])
    with pytest.raises(ValueError, match="B must have shape"):
        selective_scan(x["x"], x["dt"], x["A"], x["B"][..., :2], x["C"])
    with pytest.raises(ValueError, match=r"A must have shape \(Dm=6, N\)"):
        selective_scan(x["x"], x["dt"], x["A"][:2], x["B"], x["C"])
    with pytest.raises(ValueError, match="mode"):
        selective_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], mode="pscan")
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], initial_state=torch.zeros(1, 6, 3, dtype=F64))


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_delta_bias_and_softplus_equal_the_step_sizes_made_first(mode):
    """mamba_ssm's delta_bias / delta_softplus: dt_t = softplus(dt_t + bias), gradients included, against the
    same step sizes computed here first (raw dt of both signs: the softplus is what makes them >= 0)."""
    x = make(2, 23, seed=5)
    raw = (torch.randn(2, 23, 6, generator=torch.Generator().manual_seed(6), dtype=F64) * 2).requires_grad_()
    bias = torch.randn(6, generator=torch.Generator().manual_seed(7), dtype=F64).requires_grad_()
    h0 = state0(x)
    got, gh = selective_scan(x["x"], raw, x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=bias,
                             delta_softplus=True, mode=mode, chunk_size=8, initial_state=h0, output_final_state=True)
    dt = torch.log1p(torch.exp(raw + bias))                    # softplus written out (no threshold: |.| < 20)
    want, wh = selective_scan(x["x"], dt, x["A"], x["B"], x["C"], D=x["D"], z=x["z"], mode="recurrent",
                              initial_state=h0, output_final_state=True)
    assert_close(got, want, 1e-12, "y")
    assert_close(gh, wh, 1e-12, "state")
    g1 = torch.autograd.grad(got.sum() + gh.sum(), (raw, bias))
    g2 = torch.autograd.grad(want.sum() + wh.sum(), (raw, bias))
    for a, b in zip(g1, g2):
        assert_close(a, b, 1e-10, "gradient")
    assert bool((raw + bias < 0).any())                        # so without delta_softplus they are refused
    with pytest.raises(ValueError, match="delta_softplus=True"):
        selective_scan(x["x"], raw.detach() + bias.detach(), x["A"], x["B"], x["C"], mode=mode)
    with pytest.raises(ValueError, match="delta_bias must have shape"):
        selective_scan(x["x"], raw, x["A"], x["B"], x["C"], delta_bias=bias[:4], delta_softplus=True)
    with pytest.raises(ValueError, match="delta_softplus"):
        selective_scan(x["x"], raw, x["A"], x["B"], x["C"], delta_softplus="yes")
    with pytest.raises(ValueError, match="dt \\+ delta_bias"):          # a bias without softplus: dt + bias checked
        selective_scan(x["x"], x["dt"].detach(), x["A"], x["B"], x["C"], delta_bias=torch.full((6,), -2.0, dtype=F64))
