"""Non-finite input stays where it is: a NaN or inf at token t changes no output before t, in every form;
a log-decay of exactly -inf (a decay of 0) gives the same result in all three forms."""

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import (delta_rule, gated_delta_rule, gla, linear_attention, retention, selective_scan,
                         simple_gla, softmax_attention)

B, T, H, K, V = 2, 19, 2, 5, 3


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    return {"q": q, "k": k, "v": v, "g3": -torch.rand(B, T, H, generator=g, dtype=torch.float64),
            "g4": -torch.rand(B, T, H, K, generator=g, dtype=torch.float64),
            "beta": torch.rand(B, T, H, generator=g, dtype=torch.float64), "gh": -torch.rand(H, generator=g, dtype=torch.float64)}


OPS = {
    "linear": (lambda d, m: linear_attention(d["q"].abs(), d["k"].abs(), d["v"], mode=m, chunk_size=4)[0], "kv"),
    "linear_unnorm": (lambda d, m: linear_attention(d["q"], d["k"], d["v"], normalize=False, mode=m, chunk_size=4)[0], "kv"),
    "retention": (lambda d, m: retention(d["q"], d["k"], d["v"], d["gh"], mode=m, chunk_size=4)[0], "kv"),
    "simple_gla": (lambda d, m: simple_gla(d["q"], d["k"], d["v"], d["g3"], mode=m, chunk_size=4)[0], "kvg"),
    "gla": (lambda d, m: gla(d["q"], d["k"], d["v"], d["g4"], mode=m, chunk_size=4)[0], "kvg"),
    "delta_rule": (lambda d, m: delta_rule(d["q"], d["k"], d["v"], d["beta"], mode=m, chunk_size=4)[0], "kv"),
    "gated_delta_rule": (lambda d, m: gated_delta_rule(d["q"], d["k"], d["v"], d["g3"], d["beta"], mode=m,
                                                       chunk_size=4)[0], "kvg"),
    "softmax": (lambda d, m: softmax_attention(d["q"], d["k"], d["v"], mode=m, chunk_size=4)[0], "kv"),
    "swa": (lambda d, m: softmax_attention(d["q"], d["k"], d["v"], window=5, mode=m, chunk_size=4)[0], "kv"),
}


def _scan(d, m):
    x, dt = d["v"].flatten(2), d["g3"].neg().repeat(1, 1, 3)            # (B, T, 6) each
    A = -torch.arange(1, 5, dtype=torch.float64).repeat(6, 1)
    return selective_scan(x, dt, A, d["k"][:, :, 0, :4], d["q"][:, :, 0, :4], mode=m, chunk_size=4)[0]


def _poison(d, name, t, value):
    d = {n: x.clone() for n, x in d.items()}
    if name == "k":
        d["k"][:, t, :, 1] = value
    elif name == "v":
        d["v"][:, t, :, 0] = value
    else:
        for n in ("g3", "g4"):
            d[n][:, t] = value if value != float("inf") else -value    # a log-decay <= 0: -inf
    return d


@pytest.mark.parametrize("mode", ["parallel", "chunk", "recurrent"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("op", sorted(OPS) + ["selective_scan"])
def test_a_non_finite_token_changes_nothing_before_it(op, value, mode):
    fn, tensors = (_scan, "kv") if op == "selective_scan" else OPS[op]
    clean = fn(inputs(), mode)
    for name in tensors:
        for t in (0, 6, 11, T - 1):                         # inside chunks and on their edges
            got = fn(_poison(inputs(), name, t, value), mode)
            assert torch.equal(got[:, :t], clean[:, :t]) or torch.allclose(got[:, :t], clean[:, :t], rtol=1e-12,
                                                                           atol=1e-12), \
                f"{op} {mode}: {value} in {name} at token {t} changed earlier outputs"


@pytest.mark.parametrize("op", ["simple_gla", "gla", "gated_delta_rule"])
def test_a_decay_of_exactly_zero_agrees_in_all_three_forms(op):
    fn, _ = OPS[op]
    d = inputs(3)
    for n in ("g3", "g4"):
        d[n][:, 7] = float("-inf")                          # the state is wiped at token 7
    outs = {m: fn(d, m) for m in ("parallel", "recurrent", "chunk")}
    ref = outs["recurrent"]
    assert torch.isfinite(ref).all()
    for m in ("parallel", "chunk"):
        torch.testing.assert_close(outs[m], ref, rtol=1e-10, atol=1e-10, msg=f"{op} {m} with g = -inf")
    # token 7 onwards sees nothing before 7: the same as running from token 7 alone
    tail = {n: (x[:, 7:] if x.dim() > 1 else x) for n, x in d.items()}
    for n in ("g3", "g4"):
        tail[n][:, 0] = 0.0
    torch.testing.assert_close(ref[:, 7:], fn(tail, "recurrent"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("values, recomputed", [
    ([1.0, -2.0, 3.0], False),
    ([3e38, 3e38, -1.0], False),              # finite values whose sum overflows: looked at one by one, kept
    ([1.0, float("nan"), 2.0], True),
    ([1.0, float("inf"), 2.0], True),
    ([float("inf"), float("-inf"), 1.0], True),
])
def test_causal_guard_recomputes_exactly_when_the_state_is_not_finite(values, recomputed):
    from subquad.ops.common.precision import causal_guard, set_checks
    set_checks(True)
    try:
        state = torch.tensor(values, dtype=torch.float32)
        out = causal_guard("chunked", state, lambda: "recurrent", tokens=5)
    finally:
        set_checks(None)
    assert out == ("recurrent" if recomputed else "chunked")
