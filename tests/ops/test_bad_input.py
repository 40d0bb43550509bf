"""Bad input to any public op is a ValueError that names the argument: never an AttributeError, a
TypeError from deep inside, or a silently accepted value."""

import inspect
import math

import pytest
import torch

import subquad.ops as ops
from subquad.ops import (delta_rule, gated_delta_rule, gla, linear_attention, retention, selective_scan,
                         simple_gla, softmax_attention)
from tests.ops.tiny import FAMILY, inputs, stateful

B, T, H, K, V = 2, 5, 2, 4, 3
q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
g3, g4, gh, beta = -torch.rand(B, T, H), -torch.rand(B, T, H, K), -torch.rand(H), torch.rand(B, T, H)
x, dt, A = torch.randn(B, T, 6), torch.rand(B, T, 6), -torch.rand(6, 4)
Bm, Cm = torch.randn(B, T, 4), torch.randn(B, T, 4)
OPS = {
    "linear_attention": (linear_attention, [q, k, v], ["q", "k", "v"]),
    "retention": (retention, [q, k, v, gh], ["q", "k", "v", "g"]),
    "simple_gla": (simple_gla, [q, k, v, g3], ["q", "k", "v", "g"]),
    "gla": (gla, [q, k, v, g4], ["q", "k", "v", "g"]),
    "delta_rule": (delta_rule, [q, k, v, beta], ["q", "k", "v", "beta"]),
    "gated_delta_rule": (gated_delta_rule, [q, k, v, g3, beta], ["q", "k", "v", "g", "beta"]),
    "softmax_attention": (softmax_attention, [q, k, v], ["q", "k", "v"]),
    "selective_scan": (selective_scan, [x, dt, A, Bm, Cm], ["x", "dt", "A", "B", "C"]),
}
GATES = ("g", "beta", "dt", "A")      # may be float64 beside float32 activations (gates stay precise)


def bad_values(t):
    return [t.tolist(), None, 3.0, t[0], t.unsqueeze(0), t.long(), t.double(), t.to("meta")]


CASES = [(op, i, j) for op, (_, args, _) in OPS.items() for i in range(len(args)) for j in range(8)]


@pytest.mark.parametrize("op,i,j", CASES)
def test_a_bad_tensor_argument_is_a_value_error_naming_it(op, i, j):
    fn, args, names = OPS[op]
    bad = bad_values(args[i])[j]
    args = list(args)
    args[i] = bad
    if isinstance(bad, torch.Tensor) and bad.dtype == torch.float64 and names[i] in GATES:
        fn(*args)                                           # a float64 gate is allowed
        return
    with pytest.raises(ValueError) as e:
        fn(*args)
    msg = str(e.value)
    assert names[i] in msg or (names[i] in "qkvx" and any(f"{c} " in msg or f"{c}'s" in msg for c in "qkvx")), msg


KEYWORDS = {"mode": ["fast", None, 1], "chunk_size": [None, 0, -1, 1.5, True, "64"], "scale": ["x", [1.0]],
            "initial_state": ["s", torch.zeros(1), (torch.zeros(1),)]}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("kw", sorted(KEYWORDS))
def test_a_bad_keyword_is_a_value_error_naming_it(op, kw):
    fn, args, _ = OPS[op]
    if op == "selective_scan" and kw == "scale":
        return                                              # the scan has no scale
    for bad in KEYWORDS[kw]:
        with pytest.raises(ValueError, match=kw):
            fn(*args, **{kw: bad})


def test_the_gated_rule_needs_its_gate():
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule(q, k, v, None, beta)


# ---- issue 32, "Ops: bad input": each case below was accepted, or failed unclearly, before ----
FORMS = sorted(n for n in FAMILY if FAMILY[n] in ops.OPS)                 # every op and its three forms
STATEFUL = [n for n in FORMS if stateful(n)]
SCALED = [n for n in FORMS if "scale" in inspect.signature(getattr(ops, n)).parameters] + ["linformer_attention",
                                                                                            "naive_softmax_attention"]


def call(name, **kw):
    return getattr(ops, name)(*inputs(name, **{k: kw.pop(k) for k in ("b", "t", "dtype") if k in kw}).values(), **kw)


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_a_non_finite_scale_is_refused(name, scale):
    with pytest.raises(ValueError, match="scale must be finite"):
        call(name, scale=scale)


@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunk", "naive"])
@pytest.mark.parametrize("window", [None, 2])
def test_softmax_with_scale_zero_is_uniform_attention_and_a_negative_scale_matches_the_spec(form, window):
    x = inputs("softmax_attention", b=2, dtype=torch.float64)
    fn = getattr(ops, f"{form}_softmax_attention")
    T = x["v"].shape[1]
    mean = x["v"].cumsum(1) / torch.arange(1, T + 1, dtype=torch.float64).view(1, T, 1, 1)   # causal mean
    if window is not None:                                   # the mean of the last window + 1 values
        c = torch.cat([torch.zeros_like(x["v"][:, :1]), x["v"].cumsum(1)], 1)
        lo = torch.clamp(torch.arange(T) - window, min=0)
        mean = (c[:, 1:] - c[:, lo]) / (torch.arange(T) - lo + 1).view(1, T, 1, 1).double()
    torch.testing.assert_close(fn(*x.values(), scale=0.0, window=window)[0], mean, rtol=1e-12, atol=1e-12)
    ref = ops.naive_softmax_attention(*x.values(), scale=-0.7, window=window)[0]
    torch.testing.assert_close(fn(*x.values(), scale=-0.7, window=window)[0], ref, rtol=1e-12, atol=1e-12)


FLAGS = [(n, f) for n in FORMS + ["naive_softmax_attention", "linformer_attention"]
         for f in ("output_final_state", "normalize", "causal", "return_lse", "allow_neg_eigval")
         if f in inspect.signature(getattr(ops, n)).parameters]


@pytest.mark.parametrize("name,flag", FLAGS)
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_a_flag_must_be_a_bool(name, flag, value):
    with pytest.raises(ValueError, match=f"{flag} must be a bool"):
        call(name, **{flag: value})


def _state(name, dtype):
    state = call(name, dtype=dtype, output_final_state=True)[1]
    return tuple(state) if isinstance(state, tuple) else state


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("inputs_dtype,state_dtype", [(torch.float32, torch.float64), (torch.float32, torch.float16),
                                                      (torch.float32, torch.bfloat16), (torch.float64, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16)])
def test_an_initial_state_of_another_dtype_is_refused(name, inputs_dtype, state_dtype):
    """The rule (subquad/ops/common/checks.py): a state has state_dtype(q.dtype) - float32 for 16- and 32-bit
    inputs, float64 for float64 - and another dtype is refused, never cast."""
    if FAMILY[name] == "softmax_attention":                  # a KV cache holds keys and values in q's dtype
        cache = call(name, dtype=inputs_dtype, output_final_state=True)[1]
        call(name, dtype=inputs_dtype, initial_state=cache)
        if state_dtype != inputs_dtype:
            with pytest.raises(ValueError, match="initial_state's keys must have q's dtype"):
                call(name, dtype=inputs_dtype, initial_state=(cache.k.to(state_dtype), cache.v.to(state_dtype)))
        return
    good = _state(name, inputs_dtype)
    want = torch.float64 if inputs_dtype == torch.float64 else torch.float32
    assert all(s.dtype == want for s in (good if isinstance(good, tuple) else (good,)))
    call(name, dtype=inputs_dtype, initial_state=good)                        # the state's own dtype: accepted
    bad = tuple(s.to(state_dtype) for s in good) if isinstance(good, tuple) else good.to(state_dtype)
    with pytest.raises(ValueError, match=rf"initial_state.* must have the state's dtype {want}"):
        call(name, dtype=inputs_dtype, initial_state=bad)


@pytest.mark.parametrize("name", ["ssd", "parallel_ssd", "chunk_ssd"])
def test_ssd_checks_dtypes_as_the_selective_scan_does(name):
    x = inputs(name)
    with pytest.raises(ValueError, match="B must have x's dtype"):
        getattr(ops, name)(x["x"].double(), x["dt"], x["A"], x["B"], x["C"])
    with pytest.raises(ValueError, match="C must have x's dtype"):
        getattr(ops, name)(x["x"], x["dt"], x["A"], x["B"], x["C"].double())
    with pytest.raises(ValueError, match="dt must be float32, float64 or x's dtype"):
        getattr(ops, name)(x["x"], x["dt"].half(), x["A"], x["B"], x["C"])
    with pytest.raises(ValueError, match="D must be float32, float64 or x's dtype"):
        getattr(ops, name)(*x.values(), D=torch.ones(x["x"].shape[2], dtype=torch.float16))
    y, _ = getattr(ops, name)(x["x"], x["dt"].double(), x["A"].double(), x["B"], x["C"])   # float64 gates: fine
    assert y.dtype == torch.float32


def test_a_kv_cache_with_keys_and_values_of_two_dtypes_or_given_as_lists_is_refused():
    x = inputs("softmax_attention")
    cache = ops.softmax_attention(*x.values(), output_final_state=True)[1]
    for mode in ("parallel", "recurrent", "chunk"):
        with pytest.raises(ValueError, match="initial_state's values must have q's dtype"):
            ops.softmax_attention(*x.values(), mode=mode, initial_state=(cache.k, cache.v.double()))
        with pytest.raises(ValueError, match="initial_state's values must have q's dtype"):
            ops.softmax_attention(*x.values(), mode=mode, initial_state=ops.KVCache(cache.k, cache.v.half()))
        with pytest.raises(ValueError, match="initial_state must be a KVCache or a pair of tensors"):
            ops.softmax_attention(*x.values(), mode=mode, initial_state=[cache.k.tolist(), cache.v.tolist()])
    with pytest.raises(ValueError, match="KVCache needs tensors"):
        ops.KVCache(cache.k.tolist(), cache.v.tolist())
    with pytest.raises(ValueError, match="on one device"):
        ops.KVCache(cache.k, cache.v.to("meta"))


@pytest.mark.parametrize("name", FORMS + ["naive_softmax_attention", "linformer_attention"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_batch_of_zero_gives_empty_outputs_and_states(name, grad):
    x = inputs(name, b=0)
    for t in x.values():
        t.requires_grad_(grad)
    kw = {} if name == "linformer_attention" else {"output_final_state": True}
    o, state = getattr(ops, name)(*x.values(), **kw)
    assert o.shape[0] == 0 and o.shape[1:] == getattr(ops, name)(*inputs(name).values())[0].shape[1:]
    if name == "linformer_attention":
        return
    parts = (state.k, state.v) if isinstance(state, ops.KVCache) else state if isinstance(state, tuple) else (state,)
    assert all(s.shape[0] == 0 for s in parts)
    if grad:
        o.sum().backward()
        assert all(t.grad is None or t.grad.shape == t.shape for t in x.values())


@pytest.mark.parametrize("name", FORMS)
def test_cu_seqlens_on_the_meta_device_is_refused(name):
    with pytest.raises(ValueError, match="cu_seqlens must hold its lengths"):
        call(name, cu_seqlens=torch.tensor([0, 2, 5], device="meta"))


@pytest.mark.parametrize("name", [n for n in FORMS if not n.startswith(("parallel_", "recurrent_"))])
@pytest.mark.parametrize("grad", [False, True])
def test_a_chunk_size_past_the_length_is_one_chunk(name, grad):
    x = inputs(name, t=5, dtype=torch.float64)
    for t in x.values():
        t.requires_grad_(grad)
    fn = getattr(ops, name)
    o_huge, s_huge = fn(*x.values(), chunk_size=2 ** 40, output_final_state=True)
    o, s = fn(*x.values(), chunk_size=5, output_final_state=True)
    torch.testing.assert_close(o_huge, o, rtol=1e-12, atol=1e-12)
    flat = (lambda st: [st.k, st.v] if isinstance(st, ops.KVCache) else list(st) if isinstance(st, tuple) else [st])
    for a, b in zip(flat(s_huge), flat(s), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", FORMS + ["naive_softmax_attention"])
def test_chunk_size_none_is_refused_by_every_form(name):
    """One rule for every form: chunk_size is a positive int (the forms that do not chunk check it too)."""
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got None"):
        call(name, chunk_size=None)


@pytest.mark.parametrize("name", [n for n in FORMS if FAMILY[n] == "linear_attention"])
@pytest.mark.parametrize("eps", ["1e-6", math.nan, math.inf, -1e-6, None, True])
def test_eps_must_be_a_finite_number_at_least_zero(name, eps):
    with pytest.raises(ValueError, match="eps must be"):
        call(name, eps=eps)
    call(name, eps=0)                                        # no epsilon: valid


@pytest.mark.parametrize("bad", [None, "list", 1.0, "int", "bool", "meta", "rows"])
@pytest.mark.parametrize("which", ["E", "F"])
def test_linformer_refuses_bad_projections_naming_them(bad, which):
    x = inputs("linformer_attention")
    P = x[which]
    x[which] = {"list": P.tolist(), "int": P.long(), "bool": P.bool(), "meta": P.to("meta"),
                "rows": torch.cat([P, P[:1]])}.get(bad, bad)
    with pytest.raises(ValueError, match=rf"\b{which}\b (must|and)|E and F"):
        ops.linformer_attention(*x.values())


def test_linformer_chunk_size_runs_the_queries_in_blocks():
    x = inputs("linformer_attention", t=7, dtype=torch.float64)
    o, _ = ops.linformer_attention(*x.values())
    for C in (1, 3, 7, 100):
        torch.testing.assert_close(ops.linformer_attention(*x.values(), chunk_size=C)[0], o, rtol=1e-12, atol=1e-12)
    for C in (0, -1, 2.0, "4"):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            ops.linformer_attention(*x.values(), chunk_size=C)
