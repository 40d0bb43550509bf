import pytest
import torch

from subquad.ops import FEATURE_MAPS, feature_map, linear_attention, naive_softmax_attention
from tests.ops.harness import rel_err


def test_every_map_is_reachable_by_name_and_keeps_leading_dims():
    x = torch.randn(2, 7, 3, 8)
    for name in FEATURE_MAPS:
        phi = feature_map(name, head_dim=8) if name == "performer" else feature_map(name)
        y = phi(x)
        assert y.shape[:-1] == x.shape[:-1] and y.shape[-1] == phi.out_dim(8)
        if name not in ("identity", "taylor"):
            assert (y >= 0).all(), name
        kern = (y[:, :, :, None] * y[:, :, None]).sum(-1)
        if name in ("elu+1", "performer", "taylor"):  # strictly positive kernel (taylor: 1 + s + s^2/2)
            assert (kern > 0).all(), name
        if name == "relu":  # only non-negative: the normaliser's eps guards a zero
            assert (kern >= 0).all()


def test_taylor_kernel_is_second_order_exp():
    q, k = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    phi = feature_map("taylor")
    s = (q * k).sum(-1) / 16 ** 0.5
    assert torch.allclose((phi(q) * phi(k)).sum(-1), 1 + s + s * s / 2, atol=1e-12)


def _performer_vs_softmax(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 64, 1, 16, generator=g, dtype=torch.float64) * 0.7 for _ in range(3))
    phi = feature_map("performer", head_dim=16, num_features=m, seed=seed).double()
    o, _ = linear_attention(phi(q, is_query=True), phi(k), v, normalize=True, eps=0.0, scale=1.0, mode="chunk")
    o_ref, _ = naive_softmax_attention(q, k, v)
    return rel_err(o, o_ref)


def test_performer_approaches_softmax_as_features_grow():
    errs = {m: sum(_performer_vs_softmax(m, s) for s in range(3)) / 3 for m in (16, 16384)}
    assert errs[16384] < 0.1, errs
    assert errs[16384] < errs[16] / 4, errs


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_causal_outputs_never_see_the_future(name):
    # Change every token after t = 20, hugely: outputs up to t must not move.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, 21:] = 50 * torch.randn(1, 19, 2, 8, generator=g, dtype=torch.float64)
    phi = (feature_map(name, head_dim=8) if name == "performer" else feature_map(name)).double()
    for mode in ("chunk", "parallel"):
        o1, _ = linear_attention(phi(q, is_query=True), phi(k), v, mode=mode, normalize=name != "identity", chunk_size=16)
        o2, _ = linear_attention(phi(q2, is_query=True), phi(k2), v2, mode=mode, normalize=name != "identity", chunk_size=16)
        assert torch.equal(o1[:, :21], o2[:, :21]), (name, mode)


def test_performer_redraw_changes_features_and_is_seeded():
    a = feature_map("performer", head_dim=8, num_features=32, seed=3)
    b = feature_map("performer", head_dim=8, num_features=32, seed=3)
    assert torch.equal(a.weight, b.weight)
    w = a.weight.clone()
    a.redraw()
    assert not torch.equal(a.weight, w)
    a.redraw(seed=3)
    assert torch.equal(a.weight, w)


def test_performer_is_finite_for_large_inputs():
    phi = feature_map("performer", head_dim=32, num_features=64)
    x = 30 * torch.randn(2, 50, 2, 32)
    assert torch.isfinite(phi(x)).all() and torch.isfinite(phi(x, is_query=True)).all()


def test_bad_names_and_options_raise():
    with pytest.raises(ValueError, match="feature map must be one of"):
        feature_map("cosine")
    with pytest.raises(ValueError, match="head_dim"):
        feature_map("performer")
    with pytest.raises(ValueError, match="takes no options"):
        feature_map("relu", num_features=3)
    with pytest.raises(ValueError, match="head_dim=8"):
        feature_map("performer", head_dim=8)(torch.randn(3, 9))
