import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from subquad.ops import feature_map, linear_attention
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split

F64 = torch.float64


def make(B, T, H=2, K=5, V=3, seed=0, dtype=F64, positive=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    if positive:  # normalised attention needs phi(q).phi(k) > 0, as a feature map gives
        q, k = q.exp() * 0.5, k.exp() * 0.5
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    return {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_()}


def state0(inputs, normalize, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, _, H, K = inputs["q"].shape
    V = inputs["v"].shape[-1]
    S = torch.randn(B, H, K, V, generator=g, dtype=F64).requires_grad_()
    if not normalize:
        return S
    return (S, torch.rand(B, H, K, generator=g, dtype=F64).add_(0.5).requires_grad_())


def caller(normalize):
    def call(mode, x, chunk_size, initial_state, out):
        return linear_attention(x["q"], x["k"], x["v"], normalize=normalize, mode=mode, chunk_size=chunk_size,
                                initial_state=initial_state, output_final_state=out)
    return call


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("T", [1, 7, 64, 100, 257])
def test_forms_agree_fixed_lengths(T, normalize):
    x = make(2, T, seed=T)
    for C in (16, 64):  # 64 divides 64 and 257 is prime: both cases
        check_forms_agree(caller(normalize), x, C)
        check_forms_agree(caller(normalize), x, C, initial_state=state0(x, normalize))


@given(B=st.integers(1, 3), T=st.integers(1, 90), H=st.integers(1, 3), K=st.integers(1, 9),
       V=st.integers(1, 9), C=st.integers(1, 40), normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_forms_agree_property(B, T, H, K, V, C, normalize, seed):
    x = make(B, T, H, K, V, seed=seed)
    check_forms_agree(caller(normalize), x, C, initial_state=state0(x, normalize, seed + 1))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
@pytest.mark.parametrize("split", [1, 13, 50])
def test_split_sequence_equals_one_call(mode, split, normalize):
    x = make(2, 77, seed=split)
    check_split(caller(normalize), x, split, chunk_size=16, mode=mode, seq_keys=("q", "k", "v"))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("T,C", [(1, 4), (33, 8), (64, 16), (70, 64)])
def test_gradients_agree(T, C, normalize):
    x = make(2, T, K=4, V=6, seed=T)
    check_grads_agree(caller(normalize), x, C, state0(x, normalize))


def test_float32_long_sequence_chunk_matches_recurrent():
    g = torch.Generator().manual_seed(0)
    phi = feature_map("elu+1")
    q, k = (phi(torch.randn(1, 4096, 2, 32, generator=g)) for _ in range(2))
    v = torch.randn(1, 4096, 2, 32, generator=g)
    for normalize in (False, True):
        # each entry against float64, within float32 accumulation error of that entry: the error scales with
        # the magnitude of the 4,096 terms it sums (sum_s |A_ts v_s|, normalised like the output), not with
        # the entry itself, which cancellation can make small - and not with the largest entry of all
        ref, _ = linear_attention(q.double(), k.double(), v.double(), normalize=normalize, mode="parallel")
        mag, _ = linear_attention(q.double(), k.double(), v.double().abs(), normalize=normalize, mode="parallel")
        for mode in ("chunk", "recurrent"):
            o, _ = linear_attention(q, k, v, normalize=normalize, mode=mode)
            err = (o.double() - ref).abs()
            assert (err <= 1e-4 * ref.abs() + 2e-5 * mag).all(), f"{mode}: {(err / mag).max():.2e} of the sum's magnitude"


def test_low_precision_inputs_keep_float32_state():
    x = make(1, 20, dtype=torch.bfloat16)
    q, k, v = (t.detach() for t in x.values())
    o, (S, z) = linear_attention(q, k, v, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32 and z.dtype == torch.float32
    o_ref, _ = linear_attention(q.double(), k.double(), v.double())
    assert_close(o.double(), o_ref, 2e-2, "bf16 vs f64")


def test_chunk_never_builds_per_token_outer_products():
    # The textbook cumsum form allocates T*H*K*V numbers; the chunk form's largest
    # temporaries are chunk-sized. A (1, 4096, 1, 256, 256) tensor would be 1 GiB.
    q = k = torch.rand(1, 4096, 1, 256)
    v = torch.randn(1, 4096, 1, 256)
    with torch.profiler.profile(profile_memory=True) as prof:
        linear_attention(q, k, v, normalize=False, chunk_size=64)
    peak_alloc = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage), default=0)
    assert peak_alloc < 8 * 2**20, f"a {peak_alloc / 2**20:.1f} MiB temporary: per-token K x V products?"


@pytest.mark.parametrize("bad, match", [
    (dict(mode="fast"), "mode"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-3), "chunk_size"),
    (dict(scale="big"), "scale"),
])
def test_bad_arguments_raise(bad, match):
    x = make(1, 8)
    with pytest.raises(ValueError, match=match):
        linear_attention(x["q"], x["k"], x["v"], **bad)


def test_bad_tensors_raise():
    x = {n: t.detach() for n, t in make(1, 8).items()}
    q, k, v = x["q"], x["k"], x["v"]
    with pytest.raises(ValueError, match="k must match q"):
        linear_attention(q, k[:, :5], v)
    with pytest.raises(ValueError, match="v must be"):
        linear_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="k must have q's dtype"):
        linear_attention(q, k.float(), v)
    with pytest.raises(ValueError, match=r"q must have shape \(B, T, H, K\)"):
        linear_attention(q[0], k, v)
    with pytest.raises(ValueError, match="initial_state"):
        linear_attention(q, k, v, normalize=True, initial_state=torch.zeros(1, 2, 5, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"initial_state must have shape"):
        linear_attention(q, k, v, normalize=False, initial_state=torch.zeros(1, 2, 3, 3, dtype=F64))
    if torch.device("meta") != q.device:
        with pytest.raises(ValueError, match="device"):
            linear_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("normalize", [False, True])
def test_decode_step_continues_a_chunk_prefill(normalize):
    from subquad.ops.linear import linear_attention_step

    x = {n: t.detach() for n, t in make(2, 30, seed=9).items()}
    q, k, v = x["q"], x["k"], x["v"]
    o_full, _ = linear_attention(q, k, v, normalize=normalize)
    _, state = linear_attention(q[:, :20], k[:, :20], v[:, :20], normalize=normalize, output_final_state=True)
    steps = []
    for t in range(20, 30):
        o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state)
        steps.append(o_t)
    assert_close(torch.stack(steps, 1), o_full[:, 20:], 1e-10, "decode steps")


@pytest.mark.parametrize("normalize", [False, True])
def test_a_decode_step_leaves_the_state_passed_in_as_it_was(normalize):
    """It returns a new state: the one passed in can be stepped again (two samples from one prompt) and gives
    the same answer. (The step used to add k v^T into S, and k into z, in place.)"""
    from subquad.ops.linear import linear_attention_step

    x = {n: t.detach() for n, t in make(2, 9, seed=10).items()}
    q, k, v = x["q"], x["k"], x["v"]
    _, state = linear_attention(q[:, :8], k[:, :8], v[:, :8], normalize=normalize, output_final_state=True)
    before = [t.clone() for t in (state if normalize else (state,))]
    o1, new = linear_attention_step(q[:, 8], k[:, 8], v[:, 8], state)
    after = state if normalize else (state,)
    for b, a in zip(before, after):
        assert torch.equal(a, b), "the state passed in was modified"
    o2, _ = linear_attention_step(q[:, 8], k[:, 8], v[:, 8], state)
    assert torch.equal(o1, o2)
    assert isinstance(new, tuple) == normalize and not any(n is s for n, s in zip(new, state) if normalize)
    o_full, full = linear_attention(q, k, v, normalize=normalize, output_final_state=True)
    assert_close(o1, o_full[:, 8], 1e-10, "the step")
    assert_close(new[0] if normalize else new, full[0] if normalize else full, 1e-10, "the new state")


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("route", ["token", "chunk"])
@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (100, 32)])
def test_each_route_forced_agrees_with_the_parallel_form_gradients_included(normalize, route, T, C):
    # The chunk engine with no decay (its hand-written backward) and the token loop, against the parallel
    # form's autograd in float64, the initial state (S, or (S, z)) included; the route taken is recorded.
    from subquad.ops.common.routes import reset_routes, routes_taken

    def call(mode, x, chunk_size, initial_state, out):
        chosen = {"route": route} if mode == "chunk" else {}
        return linear_attention(x["q"], x["k"], x["v"], normalize=normalize, mode=mode, chunk_size=chunk_size,
                                initial_state=initial_state, output_final_state=out, **chosen)

    x = make(2, T, K=4, V=6, seed=T)
    reset_routes()
    check_forms_agree(call, x, C, initial_state=state0(x, normalize), modes=("chunk",))
    check_grads_agree(call, x, C, state0(x, normalize), modes=("chunk",))
    assert {r for (op, r) in routes_taken() if op == "linear_attention"} == {route}


def test_gradcheck_of_the_chunk_engine_without_decay():
    x = make(2, 11, 2, 3, 2, seed=4)
    S0 = state0(x, False)
    torch.autograd.gradcheck(lambda q, k, v, s: linear_attention(q, k, v, normalize=False, chunk_size=2, initial_state=s,
                                                                 output_final_state=True, route="chunk"),
                             (x["q"], x["k"], x["v"], S0), eps=1e-6, atol=1e-8)


def test_route_argument_is_checked():
    x = {n: t.detach() for n, t in make(1, 8).items()}
    with pytest.raises(ValueError, match="route must be None"):
        linear_attention(x["q"], x["k"], x["v"], route="exact")
    with pytest.raises(ValueError, match="route='chunk' is a route of the chunk form"):
        linear_attention(x["q"], x["k"], x["v"], mode="recurrent", route="chunk")
