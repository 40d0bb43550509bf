"""cu_seqlens: a packed batch of N sequences equals running each sequence alone - outputs, final states
and the gradients of every input and initial state - for every op and form, in float64."""

from __future__ import annotations

import random

import pytest
import torch

import subquad.ops as ops
from subquad.ops import KVCache

F64 = torch.float64
H, K, V = 2, 4, 3
TOKEN_ARGS = {"linear_attention": 3, "retention": 3, "simple_gla": 4, "gla": 4, "delta_rule": 4,
              "gated_delta_rule": 5, "softmax_attention": 3, "ssd": None, "selective_scan": None}


def _inputs(name, T, g):
    """(args, per-token flags, initial state of one sequence or None builder)."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)          # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=F64)           # noqa: E731
    if name == "ssd":
        return [r(1, T, H, V), u(1, T, H) * 0.5, -u(H) - 0.2, r(1, T, K), r(1, T, K)], [1, 1, 0, 1, 1]
    if name == "selective_scan":
        return [r(1, T, 6), u(1, T, 6) * 0.5, -u(6, K) - 0.2, r(1, T, K), r(1, T, K)], [1, 1, 0, 1, 1]
    q, k, v = r(1, T, H, K), torch.nn.functional.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V)
    if name in ("linear_attention",):
        q, k = q.exp() * 0.3, k.exp() * 0.3                        # positive features: a safe normaliser
    extra = {"retention": [torch.tensor([-0.1, -0.7], dtype=F64)], "simple_gla": [-u(1, T, H)],
             "gla": [-u(1, T, H, K)], "delta_rule": [u(1, T, H)], "gated_delta_rule": [-u(1, T, H) * 2, u(1, T, H)],
             "linear_attention": [], "softmax_attention": []}[name]
    flags = [1, 1, 1] + [int(name != "retention")] * len(extra)
    return [q, k, v] + extra, flags


def _state(name, g):
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)          # noqa: E731
    if name == "linear_attention":
        return (r(1, H, K, V).abs(), r(1, H, K).abs() + 1)
    if name == "ssd":
        return r(1, H, K, V)
    if name == "selective_scan":
        return r(1, 6, K)
    if name == "softmax_attention":
        return KVCache(r(1, 3, H, K), r(1, 3, H, V))
    return r(1, H, K, V)


def _lengths(n, seed):
    rnd = random.Random(seed)
    out = [rnd.choice([1, 2, 3, 5, 7, 9, 12, 17]) for _ in range(n)]
    if n > 1:
        out[1] = 1                                                   # a one-token sequence
    return out


def _loss(o, state, w):
    total = (o * w).sum()
    parts = state if isinstance(state, tuple) else (state,)
    for i, p in enumerate(parts):
        if isinstance(p, torch.Tensor):
            total = total + (p * (i + 1.5)).sum()
    return total


@pytest.mark.parametrize("name", list(TOKEN_ARGS))
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_equals_each_sequence_alone(name, mode, n, with_state):
    g = torch.Generator().manual_seed(hash((name, mode, n, with_state)) % 2**31)
    lengths = _lengths(n, n * 7 + len(name))
    seqs = [_inputs(name, L, g) for L in lengths]
    flags = seqs[0][1]
    packed = [torch.cat([s[0][j] for s in seqs], 1) if f else seqs[0][0][j] for j, f in enumerate(flags)]
    packed = [t.clone().requires_grad_(True) for t in packed]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    kw = dict(mode=mode, chunk_size=4, output_final_state=True)
    if name == "linear_attention":
        kw["normalize"] = True
    inits = [_state(name, g) for _ in lengths] if with_state and name != "softmax_attention" else None
    softmax_inits = [_state(name, g) if i % 2 == 0 else None for i in range(n)] if with_state else None
    op = getattr(ops, name)

    def stack(states):
        if isinstance(states[0], tuple):
            return tuple(torch.cat(p, 0).requires_grad_(True) for p in zip(*states))
        return torch.cat(states, 0).requires_grad_(True)

    init_packed = stack(inits) if inits is not None else None
    leaves = packed + (list(init_packed) if isinstance(init_packed, tuple) else [init_packed] if init_packed is not None else [])
    o, S = op(*packed, cu_seqlens=cu, initial_state=softmax_inits if name == "softmax_attention" else init_packed, **kw)
    w = torch.randn(o.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad(_loss(o, S if name != "softmax_attention" else None, w), leaves, allow_unused=True)

    outs, states, ends = [], [], 0
    for i, L in enumerate(lengths):
        s, ends = ends, ends + L
        args = [t[:, s:ends] if f else t for t, f in zip(packed, flags)]
        if name == "softmax_attention":
            init = softmax_inits[i] if softmax_inits else None
        elif init_packed is None:
            init = None
        elif isinstance(init_packed, tuple):
            init = tuple(p[i:i + 1] for p in init_packed)
        else:
            init = init_packed[i:i + 1]
        oi, Si = op(*args, initial_state=init, **kw)
        outs.append(oi)
        states.append(Si)
    ref_o = torch.cat(outs, 1)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-10)
    if name == "softmax_attention":
        assert isinstance(S, list) and len(S) == n
        for a, b in zip(S, states):
            torch.testing.assert_close(a.k, b.k, rtol=0, atol=0)
            assert a.seen == b.seen
        ref_S = None
    else:
        ref_S = tuple(torch.cat(p, 0) for p in zip(*states)) if isinstance(states[0], tuple) else torch.cat(states, 0)
        for a, b in zip(S if isinstance(S, tuple) else (S,), ref_S if isinstance(ref_S, tuple) else (ref_S,)):
            assert a.shape[0] == n
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    ref_grads = torch.autograd.grad(_loss(ref_o, ref_S, w), leaves, allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_softmax_window_stops_at_each_sequence_start():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, H, K, generator=g, dtype=F64) for _ in range(3))
    cu = torch.tensor([0, 5, 12])
    for mode in ("parallel", "recurrent", "chunk"):
        o, _ = ops.softmax_attention(q, k, v, window=3, mode=mode, chunk_size=4, cu_seqlens=cu)
        second, _ = ops.softmax_attention(q[:, 5:], k[:, 5:], v[:, 5:], window=3, mode=mode, chunk_size=4)
        torch.testing.assert_close(o[:, 5:], second, rtol=0, atol=1e-12)


def test_no_leakage_between_documents():
    """Changing document 0's tokens changes nothing in document 1 (gradient test): every op, chunk form."""
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 9, 20], dtype=torch.int64)
    for name in TOKEN_ARGS:
        args, flags = _inputs(name, 20, g)
        args = [a.requires_grad_(True) for a in args]
        o, _ = getattr(ops, name)(*args, cu_seqlens=cu, chunk_size=4)
        grads = torch.autograd.grad(o[:, 9:].sum(), args, allow_unused=True)
        for a, gr, f in zip(args, grads, flags):
            if f and gr is not None:
                assert gr[:, :9].abs().max() == 0, name


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([0, 5, 5, 10]), "strictly increasing"),
    (torch.tensor([1, 5, 10]), "start at 0"),
    (torch.tensor([0, 5, 9]), "end at T=10"),
    (torch.tensor([0.0, 10.0]), "int32 or int64"),
    (torch.tensor([[0, 10]]), "1-D"),
    (torch.tensor([0]), "at least two"),
    ([0, 10], "1-D integer tensor"),
])
def test_bad_cu_seqlens_name_it(bad, match):
    q = torch.randn(1, 10, H, K)
    with pytest.raises(ValueError, match=match) as e:
        ops.simple_gla(q, q, q, -torch.rand(1, 10, H), cu_seqlens=bad)
    assert "cu_seqlens" in str(e.value)


def test_cu_seqlens_needs_one_packed_row_and_one_state_per_sequence():
    q = torch.randn(2, 10, H, K)
    with pytest.raises(ValueError, match="batch must be 1"):
        ops.retention(q, q, q, torch.full((H,), -0.1), cu_seqlens=torch.tensor([0, 10]))
    q = torch.randn(1, 10, H, K)
    with pytest.raises(ValueError, match="one state per sequence"):
        ops.retention(q, q, q, torch.full((H,), -0.1), cu_seqlens=torch.tensor([0, 4, 10]),
                      initial_state=torch.zeros(3, H, K, K))
    with pytest.raises(ValueError, match="beta must be packed"):
        ops.delta_rule(q, q, q, torch.rand(1, 9, H), cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize("name", list(TOKEN_ARGS))
@pytest.mark.parametrize("with_state", [False, True])
def test_sequences_of_one_length_run_batched_and_still_equal(name, with_state):
    """Sequences of equal length run as one batched call (a packed training batch is mostly whole rows):
    the same equalities hold with repeated lengths, one-token sequences and softmax caches on some rows."""
    globals()["_lengths"], saved = (lambda n, seed: [4, 4, 7, 4, 1, 7]), globals()["_lengths"]
    try:
        test_packed_equals_each_sequence_alone(name, "chunk", 6, with_state)
    finally:
        globals()["_lengths"] = saved
