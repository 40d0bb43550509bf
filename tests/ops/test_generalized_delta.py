"""generalized_delta_rule (RWKV-7's diagonal-plus-rank-one transition): a definition built from matrices, the
three forms in float64 with the gradients of every input, RWKV-7-shaped and free a, b, strong decays, the
delta rule and KDA as special cases, T = 65,536, varlen, split calls, forced routes, autocast, compile."""

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import delta_rule, gated_delta_rule, generalized_delta_rule
from subquad.ops.common.routes import reset_routes, routes_taken
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(B, T, H=2, K=5, V=3, seed=0, w_min=-0.6, shape="rwkv", dtype=F64):
    """w uniform in [w_min, 0]; shape "rwkv": a = -kk, b = lr kk (kk unit, lr in [0, 1]); "free": a, b random of
    norm about 0.5 each, the transition's rank-one part |b a^T| <= about 0.25."""
    gen = torch.Generator().manual_seed(seed)
    rand = (lambda *s: torch.rand(*s, generator=gen, dtype=dtype))
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    if shape == "rwkv":
        kk = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
        a, b = -kk, rand(B, T, H, 1) * kk
    else:
        a, b = (0.5 * F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) for _ in range(2))
    x = {"q": q, "k": k, "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype), "w": w_min * rand(B, T, H, K),
         "a": a, "b": b}
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, K, x["v"].shape[-1], generator=gen, dtype=x["q"].dtype).requires_grad_()


def call(mode, x, chunk_size, initial_state, out, **kw):
    return generalized_delta_rule(x["q"], x["k"], x["v"], x["w"], x["a"], x["b"], mode=mode, chunk_size=chunk_size,
                                  initial_state=initial_state, output_final_state=out, **kw)


def definition(x, S0):
    """S_t = (diag(exp w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T with the K x K transition built: independent of the op."""
    q, k, v, w, a, b = (x[n].detach() for n in ("q", "k", "v", "w", "a", "b"))
    T, K = q.shape[1], q.shape[-1]
    S = S0.detach().clone()
    outs = []
    for t in range(T):
        A = torch.diag_embed(torch.exp(w[:, t])) + b[:, t, :, :, None] * a[:, t, :, None, :]
        S = A @ S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ S).squeeze(-2) * K ** -0.5)
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("shape", ["rwkv", "free"])
@pytest.mark.parametrize("T", [1, 37, 130])
def test_forms_agree_with_the_definition(T, shape):
    x = make(2, T, seed=T, shape=shape)
    S0 = state0(x)
    o_ref, s_ref = definition(x, S0)
    o, s = call("recurrent", x, 16, S0, True)
    assert_close(o, o_ref, 1e-10, "recurrent vs the definition: o")
    assert_close(s, s_ref, 1e-10, "recurrent vs the definition: state")
    for C in (16, 20, 64):                       # 20: rounded up to the sub-chunk's multiple, 32
        check_forms_agree(call, x, C, initial_state=S0, ref="recurrent")


@pytest.mark.parametrize("w_min", [-0.6, -20.0])              # RWKV-7's range; strong decays
@pytest.mark.parametrize("shape", ["rwkv", "free"])
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (130, 32)])
def test_gradients_of_every_input_and_the_initial_state_agree(T, C, shape, w_min):
    x = make(2, T, K=4, V=6, seed=T, w_min=w_min, shape=shape)
    check_grads_agree(call, x, C, state0(x), ref="recurrent")
    if w_min < -1:
        check_forms_agree(call, x, C, initial_state=state0(x), ref="recurrent")


def test_strong_decays_take_the_elementwise_diagonal_blocks_too(monkeypatch):
    # decay/intra.py factors the sub-chunks' diagonal blocks when the decays inside one are moderate, else
    # forms them elementwise: with SPAN emptied every block is elementwise; both agree with the token loop
    from subquad.ops.decay import intra

    monkeypatch.setattr(intra, "SPAN", {})
    x = make(2, 45, K=4, V=3, seed=7, w_min=-20.0, shape="free")
    check_grads_agree(call, x, 16, state0(x), ref="recurrent")


def test_factored_and_exact_scores_agree(monkeypatch):
    # chunks decaying by at most 2 FACTOR_LIMIT take midpoint-factored scores (one matmul), others the exact
    # sub-chunked ones (delta/chunk.py, _dplr_scores): with the limit at 0 every chunk takes the exact ones
    from subquad.ops.delta import chunk

    x = make(2, 100, K=6, V=4, seed=14, w_min=-2.0, shape="free")
    S0 = state0(x)
    runs = []
    for limit in (chunk.FACTOR_LIMIT, 0.0):
        monkeypatch.setattr(chunk, "FACTOR_LIMIT", limit)
        o, s = call("chunk", x, 32, S0, True)
        runs.append([o, s, *torch.autograd.grad(o.square().sum() + s.square().sum(), [*x.values(), S0])])
    for a, b in zip(*runs):
        assert_close(a, b, 1e-10, "factored vs exact")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_the_delta_rule_is_the_case_w_zero_a_minus_k_b_beta_k(mode):
    # (I - beta k k^T) S + beta k v^T = (diag(1) + (beta k)(-k)^T) S + k (beta v)^T
    gen = torch.Generator().manual_seed(2)
    q, k = (F.normalize(torch.randn(2, 50, 2, 6, generator=gen, dtype=F64), dim=-1) for _ in range(2))
    v, beta = torch.randn(2, 50, 2, 4, generator=gen, dtype=F64), torch.rand(2, 50, 2, generator=gen, dtype=F64)
    S0 = torch.randn(2, 2, 6, 4, generator=gen, dtype=F64)
    o_ref, s_ref = delta_rule(q, k, v, beta, mode="recurrent", initial_state=S0, output_final_state=True)
    o, s = generalized_delta_rule(q, k, v * beta[..., None], torch.zeros_like(q), -k, beta[..., None] * k,
                                  mode=mode, chunk_size=16, initial_state=S0, output_final_state=True)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(s, s_ref, 1e-10, "state")


def test_kda_is_the_case_a_minus_k_decayed_b_beta_k():
    # KDA: (I - beta k k^T) diag(e^g) S + beta k v^T = diag(e^g) S + (beta k)(-e^g o k)^T S + k (beta v)^T
    x = make(2, 70, K=6, V=4, seed=3, w_min=-2.0)
    q, k, v, g = (x[n].detach() for n in ("q", "k", "v", "w"))
    beta = torch.rand(2, 70, 2, generator=torch.Generator().manual_seed(4), dtype=F64)
    o_ref, s_ref = gated_delta_rule(q, k, v, g, beta, mode="recurrent", output_final_state=True)
    o, s = generalized_delta_rule(q, k, v * beta[..., None], g, -k * torch.exp(g), beta[..., None] * k,
                                  output_final_state=True)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(s, s_ref, 1e-10, "state")


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_split_sequence_equals_one_call(mode):
    x = make(2, 53, seed=4)
    check_split(call, x, 20, chunk_size=16, mode=mode, seq_keys=tuple(x))


def test_varlen_equals_separate_calls_values_and_gradients():
    lengths = [5, 40, 1, 33]
    x = make(1, sum(lengths), seed=8, shape="free")
    inits = torch.randn(len(lengths), 2, 5, 3, generator=torch.Generator().manual_seed(9), dtype=F64).requires_grad_()
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, S = call("chunk", x, 16, inits, True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(10)
    do, dS = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    wrt = list(x.values()) + [inits]
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), wrt)
    outs, states = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, si = call("recurrent", {n: t[:, s:e] for n, t in x.items()}, 16, inits[i:i + 1], True)
        outs.append(oi)
        states.append(si)
    o_ref, S_ref = torch.cat(outs, 1), torch.cat(states)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(S, S_ref, 1e-10, "states")
    for name, g, g_ref in zip(list(x) + ["initial_state"], grads,
                              torch.autograd.grad((o_ref * do).sum() + (S_ref * dS).sum(), wrt)):
        assert_close(g, g_ref, 1e-10, f"d{name}")


@pytest.mark.parametrize("w_min", [-20.0, -0.6])          # the exact scores; RWKV-7's range, the factored ones
def test_a_long_sequence_stays_finite_and_matches_its_start(w_min):
    # T = 65,536 in float32, no gradient: decays down to w_min on half the channels, RWKV-7-shaped a, b
    x = {n: t.detach().float() for n, t in make(1, 65536, H=1, K=8, V=8, seed=11, w_min=w_min).items()}
    x["w"][..., 1::2] *= 0.03                                 # the other half near RWKV-7's slow channels
    with torch.no_grad():
        o, S = call("chunk", x, 64, None, True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    p = 1000
    ref, _ = call("recurrent", {n: t[:, :p].double() for n, t in x.items()}, 64, None, True)
    assert_close(o[:, :p].double(), ref, 1e-4, "the first tokens against the token loop in float64")


@pytest.mark.parametrize("route,T", [("token", 3), ("chunk", 3), ("chunk", 75), ("token", 75)])
def test_each_route_forced_agrees_with_the_token_loop_and_is_recorded(route, T, monkeypatch):
    from subquad.ops.delta import chunk

    monkeypatch.setattr(chunk, "TOKEN_HEADS", 4 * 32)                 # B H = 4: groups of 32 tokens
    x = make(2, T, K=4, V=6, seed=T, w_min=-3.0)
    S0 = state0(x)

    def forced(mode, x, C, S, out):
        return call(mode, x, C, S, out, **(dict(route=route) if mode == "chunk" else {}))

    reset_routes()
    check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    check_grads_agree(forced, x, 16, S0, modes=("chunk",), ref="recurrent")
    with torch.no_grad():
        check_forms_agree(forced, x, 16, initial_state=S0, modes=("chunk",), ref="recurrent")
    assert routes_taken() == {("generalized_delta_rule", route): 3}


def test_automatic_route_takes_the_token_loop_only_for_short_calls_without_a_gradient():
    x = {n: t.detach() for n, t in make(1, 3).items()}
    reset_routes()
    call("chunk", x, 16, None, True)
    call("chunk", make(1, 3), 16, None, True)
    call("chunk", {n: t.detach() for n, t in make(1, 40).items()}, 16, None, True)
    assert routes_taken() == {("generalized_delta_rule", "token"): 1, ("generalized_delta_rule", "chunk"): 2}


@pytest.mark.parametrize("mode", ["parallel", "chunk"])
def test_bf16_autocast_is_close_to_float32(mode):
    x = {n: t.detach().float() for n, t in make(2, 70, K=16, V=16, seed=12).items()}
    ref, S_ref = call(mode, x, 32, None, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = call(mode, x, 32, None, True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_close(o.float(), ref, 3e-2, "o")
    assert_close(S, S_ref, 3e-2, "state")


def test_torch_compile_equals_eager_values_and_gradients():
    torch._dynamo.reset()
    x = make(2, 45, K=4, V=6, seed=13, w_min=-3.0, shape="free")
    S0 = state0(x)
    fn = (lambda *t: generalized_delta_rule(*t[:6], initial_state=t[6], output_final_state=True, chunk_size=16))
    runs = []
    for f in (fn, torch.compile(fn, backend="aot_eager")):
        o, S = f(*x.values(), S0)
        runs.append([o, S, *torch.autograd.grad(o.square().sum() + S.square().sum(), [*x.values(), S0])])
    for a, b in zip(*runs):
        assert_close(b, a, 1e-10, "compiled vs eager")


def test_bad_input_names_the_argument():
    x = {n: t.detach() for n, t in make(1, 9).items()}
    with pytest.raises(ValueError, match="w is a log-decay"):
        call("chunk", {**x, "w": -x["w"] + 0.1}, 16, None, False)
    with pytest.raises(ValueError, match="a must"):
        call("chunk", {**x, "a": x["a"][..., :2]}, 16, None, False)
    with pytest.raises(ValueError, match="route"):
        call("parallel", x, 16, None, False, route="chunk")
