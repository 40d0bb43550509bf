"""State passing across processes equals one process for every supported recurrent mixer, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from subquad import ops
from subquad.distributed import sequence_parallel
from tests.distributed.helpers import run
from tests.ops.harness import assert_close

T, H, K, V = 24, 2, 4, 3


def inputs(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    if kind in ("delta_rule", "gated_delta_rule"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if kind == "linear_attention":
        q, k = q.exp() * 0.3, k.exp() * 0.3
    x = {"q": q, "k": k, "v": torch.randn(2, T, H, V, generator=g, dtype=torch.float64)}
    if kind == "retention":
        x["g"] = -torch.rand(H, generator=g, dtype=torch.float64)
    if kind in ("simple_gla", "gated_delta_rule"):
        x["g"] = -torch.rand(2, T, H, generator=g, dtype=torch.float64)
    if kind == "gla":
        x["g"] = -torch.rand(2, T, H, K, generator=g, dtype=torch.float64)
    if kind in ("delta_rule", "gated_delta_rule"):
        x["beta"] = torch.rand(2, T, H, generator=g, dtype=torch.float64)
    if kind == "generalized_delta_rule":                       # RWKV-7's: a = -kk, b = lr kk, w <= 0
        kk = F.normalize(torch.randn(2, T, H, K, generator=g, dtype=torch.float64), dim=-1)
        lr = torch.rand(2, T, H, 1, generator=g, dtype=torch.float64)
        x.update(w=-0.6 * torch.rand(2, T, H, K, generator=g, dtype=torch.float64), a=-kk, b=lr * kk)
        x["v"] = torch.randn(2, T, H, K, generator=g, dtype=torch.float64)
    return x, torch.randn(2, T, H, x["v"].shape[-1], generator=g, dtype=torch.float64)


def single(kind, x, normalize):
    kw = dict(mode="recurrent")
    if kind == "linear_attention":
        return ops.linear_attention(x["q"], x["k"], x["v"], normalize=normalize, **kw)[0]
    if kind in ("retention", "simple_gla", "gla"):
        return getattr(ops, kind)(x["q"], x["k"], x["v"], x["g"], **kw)[0]
    if kind == "delta_rule":
        return ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw)[0]
    if kind == "generalized_delta_rule":
        return ops.generalized_delta_rule(x["q"], x["k"], x["v"], x["w"], x["a"], x["b"], **kw)[0]
    return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)[0]


def _piece(rank, world, kind, normalize):
    x, do = inputs(kind)
    t = T // world
    local = {n: (a if (n == "g" and kind == "retention") else a[:, rank * t:(rank + 1) * t]).clone().requires_grad_()
             for n, a in x.items()}
    o = sequence_parallel(kind, local["q"], local["k"], local["v"], g=local.get("g"), beta=local.get("beta"),
                          w=local.get("w"), a=local.get("a"), b=local.get("b"), normalize=normalize, chunk_size=4)
    (o * do[:, rank * t:(rank + 1) * t]).sum().backward()
    return {"o": o.detach(), **{n: a.grad for n, a in local.items()}}


CASES = [("linear_attention", False), ("linear_attention", True), ("retention", False), ("simple_gla", False),
         ("gla", False), ("delta_rule", False), ("gated_delta_rule", False), ("generalized_delta_rule", False)]


def test_every_kind_is_tested():
    from subquad.distributed.seqpar import KINDS

    assert sorted({kind for kind, _ in CASES}) == sorted(KINDS)


def _defaults_and_missing(rank, world):
    """sequence_parallel's normalize follows ops.linear_attention's default (True); a gate the kind needs and
    was not given, or one it does not take, is refused naming the argument."""
    x, _ = inputs("linear_attention")
    t = T // world
    q, k, v = (x[n][:, rank * t:(rank + 1) * t] for n in "qkv")
    out = {"same": torch.equal(sequence_parallel("linear_attention", q, k, v, chunk_size=4),
                               sequence_parallel("linear_attention", q, k, v, normalize=True, chunk_size=4))}
    for kind, kw, want in (("gated_delta_rule", {"beta": q[..., 0]}, "needs g"), ("delta_rule", {}, "needs beta"),
                           ("generalized_delta_rule", {"w": q, "a": q}, "needs b"),
                           ("retention", {"beta": q[..., 0], "g": q[0, 0, :, 0]}, "takes no beta")):
        try:
            sequence_parallel(kind, q, k, v, **kw)
            out[kind] = None
        except ValueError as e:
            out[kind] = want in str(e)
    return out


def test_defaults_follow_the_ops_and_missing_gates_are_named():
    for r in run(2, _defaults_and_missing):
        assert all(r.values()), r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind,normalize", CASES)
def test_state_passing_equals_one_process(world, kind, normalize):
    res = run(world, _piece, kind, normalize)
    x, do = inputs(kind)
    x = {n: a.clone().requires_grad_() for n, a in x.items()}
    o = single(kind, x, normalize)
    (o * do).sum().backward()
    assert_close(torch.cat([r["o"] for r in res], 1), o.detach(), 1e-10, "o")
    for n, a in x.items():
        got = sum(r[n] for r in res) if (n == "g" and kind == "retention") else torch.cat([r[n] for r in res], 1)
        assert_close(got, a.grad, 1e-9, f"d{n}")


def test_distributed_pieces_refuse_cu_seqlens_clearly():
    from subquad.distributed import ring_attention, sequence_parallel

    q = torch.randn(1, 8, 2, 4)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match="cu_seqlens is not supported across processes"):
        ring_attention(q, q, q, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens is not supported across processes"):
        sequence_parallel("linear_attention", q, q, q, cu_seqlens=cu)
