"""gated_delta_rule with a per-key-channel decay g (B, T, H, K) - Kimi Linear's KDA: the three-form battery
in float64, gradients of every input, split sequences, strong decays at T = 65,536, a token loop written
from the definition, and agreement with transformers' own torch reference (``modeling_kimi_linear``)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from subquad.ops import gated_delta_rule
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(B, T, H=2, K=5, V=3, seed=0, strength=1.0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    x = {"q": q, "k": k, "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
         "g": -strength * torch.rand(B, T, H, K, generator=gen, dtype=dtype),
         "beta": torch.rand(B, T, H, generator=gen, dtype=dtype)}
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    return torch.randn(B, H, K, x["v"].shape[-1], generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def call(mode, x, chunk_size, initial_state, out):
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode, chunk_size=chunk_size,
                            initial_state=initial_state, output_final_state=out)


def definition(x, S0):
    """S_t = (I - b k k^T) diag(exp g_t) S_{t-1} + b k v^T with the matrices built: independent of the ops."""
    q, k, v, g, b = (x[n].detach() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    S = S0.detach().clone()
    eye = torch.eye(K, dtype=F64)
    outs = []
    for t in range(T):
        kt = k[:, t]
        A = eye - b[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]
        S = A @ (torch.diag_embed(torch.exp(g[:, t])) @ S) + b[:, t, :, None, None] * kt[..., :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ S).squeeze(-2) * K ** -0.5)
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T", [1, 7, 16, 64, 100, 257])
def test_forms_agree_with_the_definition(T):
    x = make(2, T, seed=T)
    S0 = state0(x)
    o_ref, s_ref = definition(x, S0)
    o, s = call("recurrent", x, 16, S0, True)
    assert_close(o, o_ref, 1e-10, "recurrent vs the definition: o")
    assert_close(s, s_ref, 1e-10, "recurrent vs the definition: state")
    for C in (16, 20, 64):                       # 20: rounded up to the sub-chunk's multiple, 32
        check_forms_agree(call, x, C, initial_state=S0, ref="recurrent")


@given(B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 3), K=st.integers(1, 8), V=st.integers(1, 8),
       C=st.integers(1, 40), strength=st.sampled_from([0.01, 1.0, 8.0]), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_forms_agree_property(B, T, H, K, V, C, strength, seed):
    x = make(B, T, H, K, V, seed=seed, strength=strength)
    check_forms_agree(call, x, C, initial_state=state0(x, seed), ref="recurrent")


@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (64, 32)])
def test_gradients_of_every_input_agree(T, C):
    x = make(2, T, K=4, V=6, seed=T, strength=2.0)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(mode):
    x = make(2, 53, seed=4)
    check_split(call, x, 20, chunk_size=16, mode=mode, seq_keys=tuple(x))


@pytest.mark.parametrize("strength", [0.05, 3.0, 60.0])      # 60: sub-chunk spans past SPAN, the exact scores
@pytest.mark.parametrize("C,group", [(64, None), (20, 64)])  # 20 -> 32; groups of 64 tokens, a padded last one
def test_no_gradient_path_agrees(strength, C, group, monkeypatch):
    from subquad.ops.delta import chunk

    if group:
        monkeypatch.setattr(chunk, "TOKEN_HEADS", group * 4)          # B H = 4: groups of `group` tokens
    x = {n: t.detach() for n, t in make(2, 300, K=6, V=4, seed=3, strength=strength).items()}
    S0 = state0(x).detach()
    o_ref, s_ref = call("recurrent", x, C, S0, True)
    with torch.no_grad():
        o, s = call("chunk", x, C, S0, True)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(s, s_ref, 1e-10, "state")


def test_a_scalar_decay_repeated_per_channel_equals_gated_deltanet():
    x = make(2, 70, seed=9)
    g1 = x["g"][..., :1].detach()
    o1, s1 = gated_delta_rule(x["q"], x["k"], x["v"], g1.squeeze(-1), x["beta"], output_final_state=True)
    o2, s2 = gated_delta_rule(x["q"], x["k"], x["v"], g1.expand_as(x["g"]), x["beta"], output_final_state=True)
    assert_close(o2, o1, 1e-12, "o")
    assert_close(s2, s1, 1e-12, "state")


def test_strong_decays_and_long_sequences_stay_finite():
    # per-channel log-decays down to -50 (half the channels near 0), beta up to 1, T = 65,536, float32
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 65536, 1, 8, 8
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen)
    beta[:, ::7] = 1.0
    g = -50 * torch.rand(B, T, H, K, generator=gen)
    g[..., ::2] *= 1e-4
    x = {"q": q, "k": k, "v": v, "g": g.requires_grad_(), "beta": beta.requires_grad_()}
    o, S = call("chunk", x, 64, None, True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    grads = torch.autograd.grad(o.square().mean() + S.square().mean(), list(x.values()))
    assert all(torch.isfinite(t).all() for t in grads)
    p = 2048
    ref, _ = call("recurrent", {n: t[:, :p].detach().double() for n, t in x.items()}, 64, None, True)
    assert_close(o[:, :p].detach().double(), ref, 1e-4, "strong per-channel decays")


def test_bad_gate_shape_is_refused():
    x = {n: t.detach() for n, t in make(1, 9).items()}
    with pytest.raises(ValueError, match="g must have shape"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., :2], x["beta"])
    with pytest.raises(ValueError, match="log-decay"):
        gated_delta_rule(x["q"], x["k"], x["v"], -x["g"], x["beta"])


@pytest.mark.parametrize("T", [1, 45, 130])
def test_equals_transformers_torch_reference(T):
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 8, 12
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    g = -3 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    o_ref, s_ref = kimi.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    o_rec, s_rec = kimi.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=S0,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = (x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))   # fla's l2norm
    for mode in ("chunk", "recurrent"):
        o, s = gated_delta_rule(qn, kn, v, g, beta, mode=mode, initial_state=S0, output_final_state=True)
        for name, ref_o, ref_s in (("chunk", o_ref, s_ref), ("recurrent", o_rec, s_rec)):
            assert_close(o, ref_o.to(F64), 1e-4, f"{mode} vs transformers' {name}: o")
            assert_close(s, ref_s.to(F64), 1e-4, f"{mode} vs transformers' {name}: state")


@pytest.mark.parametrize("strength", [0.5, 8.0])
def test_factored_and_elementwise_diagonal_blocks_agree(strength, monkeypatch):
    # The sub-chunks' diagonal blocks are a matmul of exp(b - m) and exp(m - b) factors when the decays
    # inside a sub-chunk are moderate, elementwise otherwise (decay/intra.py): both give the same scores.
    from subquad.ops.decay import intra

    x = make(2, 100, K=6, V=4, seed=5, strength=strength)
    S0 = state0(x)
    o1, s1 = call("chunk", x, 32, S0, True)
    g1 = torch.autograd.grad(o1.square().sum() + s1.square().sum(), list(x.values()))
    monkeypatch.setattr(intra, "SPAN", {})                  # elementwise everywhere
    o2, s2 = call("chunk", x, 32, S0, True)
    g2 = torch.autograd.grad(o2.square().sum() + s2.square().sum(), list(x.values()))
    assert_close(o1, o2, 1e-11, "o")
    assert_close(s1, s2, 1e-11, "state")
    for a, b in zip(g1, g2):
        assert_close(a, b, 1e-10, "gradient")


@pytest.mark.parametrize("route,T", [("token", 3), ("chunk", 3), ("chunk", 75), ("token", 75)])
def test_each_route_forced_agrees_with_the_token_loop_values_and_gradients(route, T, monkeypatch):
    # route= forces the chunk form's route; the engine runs in groups of 32 tokens here (a padded last one),
    # with a gradient and without. The route taken is recorded.
    from subquad.ops.common.routes import reset_routes, routes_taken
    from subquad.ops.delta import chunk

    monkeypatch.setattr(chunk, "TOKEN_HEADS", 4 * 32)                 # B H = 4: groups of 32 tokens
    x = make(2, T, K=4, V=6, seed=T, strength=2.0)
    S0 = state0(x)

    def forced(mode, x, C, S, out):
        kw = dict(route=route) if mode == "chunk" else {}
        return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode, chunk_size=C,
                                initial_state=S, output_final_state=out, **kw)

    reset_routes()
    check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    check_grads_agree(forced, x, 16, S0, modes=("chunk",), ref="recurrent")
    with torch.no_grad():
        check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    assert routes_taken() == {("gated_delta_rule", route): 3}
