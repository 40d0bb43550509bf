"""Bad input to any public op is a ValueError that names the argument: never an AttributeError, a
TypeError from deep inside, or a silently accepted value."""

import pytest
import torch

from subquad.ops import (delta_rule, gated_delta_rule, gla, linear_attention, retention, selective_scan,
                         simple_gla, softmax_attention)

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
