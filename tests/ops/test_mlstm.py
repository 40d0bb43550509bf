"""mlstm (xLSTM's matrix memory): the three forms against the recurrence written out here in Python floats and
against transformers' own kernels, split sequences, gradients of every input and of the initial state, strong
forget gates, packed sequences and the empty state's m = 0."""

import math

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import mlstm
from tests.ops.harness import (
    assert_close,
    check_forms_agree,
    check_grads_agree,
    check_split,
)

F64 = torch.float64


def make(B, T, H=2, K=4, V=3, seed=0, forget=1.0):
    """q, k, v, the log forget gate g = logsigmoid(f) with f ~ N(forget, 3) (large ``forget``: gates near 1;
    negative: strong forgetting) and the log input gate i ~ N(0, 3) (exp(i) up to ~e^10: the stabiliser works)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    x = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V),
         "g": F.logsigmoid(3 * r(B, T, H) + forget), "i": 3 * r(B, T, H)}
    return {n: t.requires_grad_() for n, t in x.items()}


def state0(x, seed=1):
    B, _, H, K = x["q"].shape
    gen = torch.Generator().manual_seed(seed)
    V = x["v"].shape[-1]
    return tuple(t.requires_grad_() for t in (torch.randn(B, H, K, V, generator=gen, dtype=F64),
                                              torch.randn(B, H, K, generator=gen, dtype=F64),
                                              torch.randn(B, H, generator=gen, dtype=F64)))


def call(mode, x, chunk_size, initial_state, out):
    return mlstm(x["q"], x["k"], x["v"], x["g"], x["i"], mode=mode, chunk_size=chunk_size,
                 initial_state=initial_state, output_final_state=out)


def written_out(x, s0=None, eps=1e-6):
    """The recurrence token by token, head by head, with Python floats for the scalars: the independent reference."""
    q, k, v, g, i = (x[n].detach() for n in ("q", "k", "v", "g", "i"))
    B, T, H, K = q.shape
    o = torch.empty(B, T, H, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            C = torch.zeros(K, v.shape[-1], dtype=F64) if s0 is None else s0[0][b, h].detach().clone()
            n = torch.zeros(K, dtype=F64) if s0 is None else s0[1][b, h].detach().clone()
            m = 0.0 if s0 is None else s0[2][b, h].item()
            for t in range(T):
                gt, it = g[b, t, h].item(), i[b, t, h].item()
                m_new = max(gt + m, it)
                fa, ia = math.exp(gt + m - m_new), math.exp(it - m_new)
                C = fa * C + ia * torch.outer(k[b, t, h], v[b, t, h])
                n = fa * n + ia * k[b, t, h]
                qs = q[b, t, h] * K ** -0.5
                o[b, t, h] = (qs @ C) / (max(abs((qs @ n).item()), math.exp(-m_new)) + eps)
                m = m_new
    return o


@pytest.mark.parametrize("with_state", [False, True])
def test_every_form_equals_the_recurrence_written_out(with_state):
    x = make(2, 13, seed=5)
    s0 = state0(x) if with_state else None
    want = written_out(x, s0)
    for mode in ("parallel", "recurrent", "chunk"):
        o, _ = call(mode, x, 4, s0, True)
        assert_close(o, want, 1e-12, f"{mode}: o")


@pytest.mark.parametrize("T,forget", [(1, 1.0), (37, 1.0), (37, -4.0), (64, 6.0)])
def test_forms_agree_and_carry_the_stabiliser_across_chunks(T, forget):
    """Odd lengths, batch 2, strong forget gates (forget=-4: g ~ -4 per token) and gates near 1 (forget=6)."""
    x = make(2, T, seed=T, forget=forget)
    for C in (5, 16):
        check_forms_agree(call, x, C, initial_state=state0(x), ref="recurrent")
        check_forms_agree(call, x, C, ref="recurrent")


def test_a_forget_gate_of_zero_is_the_same_in_every_form():
    x = make(1, 11, seed=3)
    g = x["g"].detach().clone()
    g[:, 4] = float("-inf")
    y = {**{n: t.detach() for n, t in x.items()}, "g": g}
    check_forms_agree(call, y, 4, initial_state=tuple(t.detach() for t in state0(x)), ref="recurrent")


def test_gradients_agree_initial_state_included():
    x = make(2, 11, seed=7)
    check_grads_agree(call, x, 4, state0(x), tol=1e-9)


@pytest.mark.parametrize("mode", ["parallel", "chunk"])
def test_a_split_sequence_equals_one_call(mode):
    x = make(2, 23, seed=2)
    check_split(call, x, 10, 4, mode, seq_keys=("q", "k", "v", "g", "i"))


def test_packed_sequences_equal_separate_calls():
    x = {n: t.detach() for n, t in make(1, 17, seed=4).items()}
    cu = torch.tensor([0, 5, 6, 17])
    o, (C, n, m) = mlstm(*(x[k] for k in ("q", "k", "v", "g", "i")), cu_seqlens=cu, chunk_size=4,
                         output_final_state=True)
    for j, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oj, (Cj, nj, mj) = mlstm(*(x[k][:, a:b] for k in ("q", "k", "v", "g", "i")), mode="recurrent",
                                 output_final_state=True)
        assert_close(o[:, a:b], oj, 1e-12, f"sequence {j}")
        for got, want in ((C[j], Cj[0]), (n[j], nj[0]), (m[j], mj[0])):
            assert_close(got, want, 1e-12, f"sequence {j}: state")


def test_matches_transformers_kernels():
    """transformers' token loop and its chunkwise kernel (whole chunks: it refuses a length that is not a
    multiple of its chunk size) on transformers' layout (B, H, T, .) with raw forget pre-activations."""
    mx = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    x = {n: t.detach() for n, t in make(2, 32, seed=9).items()}
    f = torch.randn(2, 32, 2, generator=torch.Generator().manual_seed(3), dtype=F64) * 3 + 1
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    i = x["i"].transpose(1, 2)
    ours, (C, n, m) = mlstm(x["q"], x["k"], x["v"], F.logsigmoid(f), x["i"], chunk_size=8, output_final_state=True)
    h, (hC, hn, hm) = mx.mlstm_recurrent_sequence_native(q, k, v, i, f.transpose(1, 2), return_last_states=True,
                                                         eps=1e-6, dtype_state=F64)
    assert_close(ours, h.transpose(1, 2), 1e-12, "transformers' token loop")
    for a, b in ((C, hC), (n, hn), (m, hm[..., 0])):
        assert_close(a, b, 1e-12, "transformers' final state")
    h, _ = mx.mlstm_chunkwise_native_autograd(q, k, v, i, f.transpose(1, 2), return_last_states=True, chunk_size=8)
    assert_close(ours, h.transpose(1, 2), 1e-12, "transformers' chunkwise kernel")


def test_the_empty_state_has_m_zero_and_a_state_passed_in_is_not_modified():
    x = {n: t.detach() for n, t in make(1, 6, seed=1).items()}
    args = [x[k] for k in ("q", "k", "v", "g")] + [x["i"] - 6]     # weak input gates: m_t follows m_0 a while
    zeros = (torch.zeros(1, 2, 4, 3, dtype=F64), torch.zeros(1, 2, 4, dtype=F64), torch.zeros(1, 2, dtype=F64))
    o0, _ = mlstm(*args)
    o1, _ = mlstm(*args, initial_state=zeros)
    assert torch.equal(o0, o1)
    o2, _ = mlstm(*args, initial_state=zeros[:2] + (torch.full((1, 2), -30.0, dtype=F64),))
    assert 0 < (o2 - o0).abs().max() < 1e-5               # m_0 enters through eps alone (ops/xlstm/README.md)
    assert all(not t.any() for t in zeros)


def test_bad_gates_are_refused_by_name():
    x = {n: t.detach() for n, t in make(1, 4).items()}
    with pytest.raises(ValueError, match="g is a log forget gate"):
        mlstm(x["q"], x["k"], x["v"], -x["g"], x["i"])
    with pytest.raises(ValueError, match="i must have shape"):
        mlstm(x["q"], x["k"], x["v"], x["g"], x["i"][..., :1])
    with pytest.raises(ValueError, match="initial_state must be the triple"):
        mlstm(x["q"], x["k"], x["v"], x["g"], x["i"], initial_state=torch.zeros(1, 2, 4, 3, dtype=F64))


@pytest.mark.parametrize("name", ["k", "v", "i"])
def test_a_non_finite_token_changes_nothing_before_it(name):
    x = {n: t.detach() for n, t in make(2, 19, seed=6).items()}
    clean = {m: call(m, x, 4, None, False)[0] for m in ("parallel", "recurrent", "chunk")}
    bad = {n: t.clone() for n, t in x.items()}
    bad[name][:, 9] = float("nan")
    for mode, want in clean.items():
        o, _ = call(mode, bad, 4, None, False)
        assert_close(o[:, :9], want[:, :9], 1e-12, f"{mode}: a NaN in {name} at token 9")
