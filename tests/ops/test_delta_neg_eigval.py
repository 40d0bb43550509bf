"""The delta rules with ``allow_neg_eigval``: beta in [0, 2] (transition eigenvalue 1 - beta in [-1, 1]).

The foundation's float64 battery on beta in [0, 2], strong decays at T = 65,536, the refusals, and
agreement with transformers' own torch reference (OLMo-Hybrid's ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule``, which scale beta by 2 the same way)."""

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import delta_rule, gated_delta_rule
from subquad.ops.delta.chunk import chunk_delta
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64
GATED = pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])


def make(gated, B, T, H=2, K=5, V=3, seed=0, strength=1.0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    beta = 2 * torch.rand(B, T, H, generator=gen, dtype=dtype)
    beta[:, ::5] = 2.0                                      # exact reflections, the range's edge
    x = {"q": q, "k": k, "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype), "beta": beta}
    if gated:
        x["g"] = -strength * torch.rand(B, T, H, generator=gen, dtype=dtype)
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    return torch.randn(B, H, K, x["v"].shape[-1], generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


def call(mode, x, chunk_size, initial_state, out):
    kw = dict(mode=mode, chunk_size=chunk_size, initial_state=initial_state, output_final_state=out,
              allow_neg_eigval=True)
    if "g" in x:
        return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw)


def token_loop(x, S0=None):
    """S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T with the transition built as a matrix: the
    definition, independent of the ops' algebra."""
    q, k, v, b = (x[n].detach() for n in ("q", "k", "v", "beta"))
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=F64) if S0 is None else S0.detach().clone()
    eye = torch.eye(K, dtype=F64)
    outs = []
    for t in range(T):
        a = torch.exp(x["g"].detach()[:, t])[..., None, None] if "g" in x else 1.0
        kt = k[:, t]
        A = eye - b[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]
        S = a * (A @ S) + b[:, t, :, None, None] * kt[..., :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ S).squeeze(-2) * K ** -0.5)
    return torch.stack(outs, 1), S


@GATED
@pytest.mark.parametrize("T", [1, 7, 64, 100, 257])
def test_forms_agree_with_the_token_loop_for_beta_up_to_two(gated, T):
    x = make(gated, 2, T, seed=T)
    S0 = state0(x)
    o_ref, s_ref = token_loop(x, S0)
    o, s = call("recurrent", x, 16, S0, True)
    assert_close(o, o_ref, 1e-10, "recurrent vs the matrix definition: o")
    assert_close(s, s_ref, 1e-10, "recurrent vs the matrix definition: state")
    for C in (16, 64):
        check_forms_agree(call, x, C, initial_state=S0, ref="recurrent")


@GATED
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (64, 32)])
def test_gradients_agree_for_beta_up_to_two(gated, T, C):
    x = make(gated, 2, T, K=4, V=6, seed=T, strength=2.0)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")


@GATED
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(gated, mode):
    x = make(gated, 2, 53, seed=4)
    check_split(call, x, 20, chunk_size=16, mode=mode, seq_keys=tuple(x))


@GATED
@pytest.mark.parametrize("T,C,group", [(7, 16, None), (257, 5, 10), (300, 64, None)])
def test_no_grad_fast_path_agrees(gated, T, C, group):
    x = {n: t.detach() for n, t in make(gated, 2, T, K=6, V=4, seed=T, strength=1.0).items()}
    S0 = state0(x).detach()
    o_ref, s_ref = call("recurrent", x, C, S0, True)
    o, s = chunk_delta(x["q"], x["k"], x["v"], x.get("g"), x["beta"], scale=6 ** -0.5, chunk_size=C,
                       initial_state=S0, group=group)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(s, s_ref, 1e-10, "state")


@GATED
def test_reflections_strong_decays_and_long_sequences_stay_finite(gated):
    # beta up to 2 (every 3rd token exactly 2: a reflection), log-decays down to -50, T = 65,536, float32.
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 65536, 1, 8, 8
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).requires_grad_()
    beta = 2 * torch.rand(B, T, H, generator=gen)
    beta[:, ::3] = 2.0
    beta.requires_grad_()
    x = {"q": q, "k": k, "v": v, "beta": beta}
    if gated:
        x["g"] = (-50 * torch.rand(B, T, H, generator=gen)).requires_grad_()
    o, S = call("chunk", x, 64, None, True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    grads = torch.autograd.grad(o.square().mean() + S.square().mean(), list(x.values()))
    assert all(torch.isfinite(t).all() for t in grads)
    with torch.no_grad():
        o_ng, _ = call("chunk", x, 64, None, True)
    p = 2048
    ref, _ = call("recurrent", {n: t[:, :p].detach().double() for n, t in x.items()}, 64, None, True)
    assert_close(o[:, :p].detach().double(), ref, 1e-4, "with a gradient")
    assert_close(o_ng[:, :p].double(), ref, 1e-4, "without a gradient")


def test_beta_above_one_is_refused_without_the_option_and_above_two_with_it():
    x = {n: t.detach() for n, t in make(True, 1, 9).items()}
    with pytest.raises(ValueError, match=r"beta .* \[0, 1\] \(allow_neg_eigval=True admits \[0, 2\]\)"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        delta_rule(x["q"], x["k"], x["v"], x["beta"] + 0.5, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="allow_neg_eigval must be a bool"):
        delta_rule(x["q"], x["k"], x["v"], x["beta"] / 2, allow_neg_eigval=1)


def test_a_reflection_flips_the_stored_value():
    # One key, beta = 2: writing v then applying I - 2 k k^T (with v' = 0 written) negates the readout -
    # the parity behaviour eigenvalues in [0, 1] cannot produce.
    k = torch.zeros(1, 2, 1, 4, dtype=F64)
    k[..., 0] = 1.0
    v = torch.tensor([1.0, 0.0], dtype=F64).view(1, 2, 1, 1)
    beta = torch.tensor([1.0, 2.0], dtype=F64).view(1, 2, 1)
    o, _ = delta_rule(k, k, v, beta, scale=1.0, allow_neg_eigval=True, mode="recurrent")
    assert o[0, :, 0, 0].tolist() == [1.0, -1.0]


@pytest.mark.parametrize("T", [1, 45, 130])
def test_equals_transformers_torch_reference(T):
    olmo = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 8, 12
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    beta = 2 * torch.rand(B, T, H, generator=gen, dtype=F64)
    g = -3 * torch.rand(B, T, H, generator=gen, dtype=F64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    # transformers' reference runs in float32 inside and L2-normalises q, k with eps 1e-6
    o_ref, s_ref = olmo.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S0,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_rec, s_rec = olmo.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S0,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    for mode in ("chunk", "recurrent"):
        o, s = gated_delta_rule(qn, kn, v, g, beta, mode=mode, initial_state=S0, output_final_state=True,
                                allow_neg_eigval=True)
        for name, ref_o, ref_s in (("chunk", o_ref, s_ref), ("recurrent", o_rec, s_rec)):
            assert_close(o, ref_o.to(F64), 1e-4, f"{mode} vs transformers' {name}: o")
            assert_close(s, ref_s.to(F64), 1e-4, f"{mode} vs transformers' {name}: state")
