"""The mixture-of-experts MLP: equal to every expert run on every token with the router's masked weights
(float64, values and gradients), its load-balancing loss equal to a count by hand, its config refused by
name when wrong, and trainable - the trainer adds the router loss and logs it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from subquad.models import LanguageModel, ModelConfig
from subquad.models.moe import MoE


def _dense_reference(moe, x):
    """Every expert on every token, weighted by the top-k mask of the softmax (0 elsewhere)."""
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    w, idx = probs.topk(moe.top_k, -1)
    if moe.renormalize:
        w = w / w.sum(-1, keepdim=True)
    weight = torch.zeros_like(probs).scatter(-1, idx, w)                     # (..., E)
    outs = torch.stack([(F.silu(x @ moe.w_gate[e].T) * (x @ moe.w_up[e].T)) @ moe.w_down[e].T
                        for e in range(moe.experts)], -1)                   # (..., D, E)
    return (outs * weight.unsqueeze(-2)).sum(-1)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts,top_k", [(4, 2), (5, 1), (3, 3)])
def test_moe_equals_every_expert_on_every_token(experts, top_k, renormalize):
    torch.manual_seed(0)
    moe = MoE(16, 24, experts, top_k, renormalize).double()
    with torch.no_grad():
        moe.router.weight.mul_(50)                            # decisive routing: no top-k near ties
    x = torch.randn(3, 19, 16, dtype=torch.float64, requires_grad=True)
    got = moe(x)
    want = _dense_reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), [x, *moe.parameters()])
    refs = torch.autograd.grad((want * g).sum(), [x, *moe.parameters()])
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_few_float32_rows_take_the_c_product_for_experts_of_real_size(monkeypatch):
    """An inference step's few float32 rows multiply each chosen expert through ``layers.linear.linear`` (the C
    product where the kernels are built, for matrices of at least ``MIN_WEIGHTS``): within float32's rounding of
    every expert on every token in float64, at 1 and 3 rows; with gradients the matmul as before."""
    from subquad.kernels import qgemv
    from subquad.layers import linear as lin

    torch.manual_seed(0)
    moe = MoE(512, 512, 4, 2).eval()                          # 512 x 512 experts: MIN_WEIGHTS (2^18) each
    assert moe.w_up[0].numel() >= lin.MIN_WEIGHTS
    with torch.no_grad():
        moe.router.weight.mul_(20)
    calls, real = [], qgemv.f32_gemv
    monkeypatch.setattr(qgemv, "f32_gemv", lambda *a: calls.append(a[1].shape) or real(*a))
    ref = copy.deepcopy(moe).double()
    for rows in (1, 3):
        x = torch.randn(rows, 512)
        calls.clear()
        with torch.no_grad():
            got = moe(x)
            want = _dense_reference(ref, x.double())
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        if lin.ONEDNN and qgemv.F32.available():              # three products per expert chosen by any row
            assert len(calls) == 3 * len(set(moe.route(x)[2].flatten().tolist()))
    x = torch.randn(2, 512, requires_grad=True)
    calls.clear()
    moe(x).sum().backward()
    assert not calls and x.grad is not None


def test_relu2_latent_experts_equal_every_expert_on_every_token():
    """kind "relu2" (ungated squared-ReLU experts and shared expert) with ``latent`` experts and sigmoid grouped
    routing (Nemotron-H's MoE) equals the dense sum written out, values and gradients."""
    torch.manual_seed(0)
    moe = MoE(16, 24, 6, 2, True, shared=20, shared_gate=False, router="sigmoid", groups=3, topk_groups=2,
              scale=2.5, kind="relu2", latent=10).double()
    assert not hasattr(moe, "w_gate") and moe.w_up.shape == (6, 24, 10) and moe.w_down.shape == (6, 10, 24)
    with torch.no_grad():
        moe.router.weight.mul_(5)                            # decisive, unsaturated sigmoid scores: no ties
        moe.score_bias.copy_(torch.randn(6) * 0.1)
    x = torch.randn(3, 19, 16, dtype=torch.float64, requires_grad=True)
    s = torch.sigmoid(x @ moe.router.weight.T)                                # (..., E)
    choice = (s + moe.score_bias).view(3, 19, 3, 2)
    keep = choice.sum(-1).topk(2, -1).indices                                 # each group's two experts
    mask = torch.zeros(3, 19, 3, dtype=torch.bool).scatter(-1, keep, True).repeat_interleave(2, -1)
    idx = (s + moe.score_bias).masked_fill(~mask, float("-inf")).topk(2, -1).indices
    w = s.gather(-1, idx)
    weight = torch.zeros_like(s).scatter(-1, idx, 2.5 * w / w.sum(-1, keepdim=True))
    h = moe.latent_in(x)
    outs = torch.stack([F.relu(h @ moe.w_up[e].T).square() @ moe.w_down[e].T for e in range(6)], -1)
    want = moe.latent_out((outs * weight.unsqueeze(-2)).sum(-1)) + moe.shared(x)
    assert moe.shared.w_down.weight.shape == (16, 20) and not hasattr(moe.shared, "w_gate")
    got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    params = [p for p in moe.parameters()]
    for a, b in zip(torch.autograd.grad((got * g).sum(), [x, *params]),
                    torch.autograd.grad((want * g).sum(), [x, *params])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["swiglu", "relu2"])
def test_a_decoding_steps_rows_stay_in_one_compiled_graph(kind):
    """A few rows (rows * k <= 4 E, moe.GATHER: a decoding step) under torch.compile take the by-index path (``_gathered``):
    one graph (``fullgraph`` would raise at a break) equal to the dense sum written out; its eager form
    equals it too in float64. Many rows run the routed loop as the op ``subquad::moe_experts``: one graph too,
    equal to the dense sum; a deep copy's op runs the copy's own experts (swiglu); with gradients on, the loop
    runs outside the graph and gradients reach the experts (relu2) - one kind each: the op and the loop are the
    same code for both kinds, and each compile costs ~10 s of the suite."""
    torch.manual_seed(0)
    moe = MoE(16, 24, 8, 2, True, shared=12, kind=kind, latent=10 if kind == "relu2" else None).double()
    with torch.no_grad():
        moe.router.weight.mul_(50)
    x = torch.randn(3, 16, dtype=torch.float64)
    h = x if moe.latent_in is None else moe.latent_in(x)
    if kind == "swiglu":
        want = _dense_reference(moe, x) + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)
    else:
        probs = torch.softmax(x @ moe.router.weight.T, -1)
        w, idx = probs.topk(2, -1)
        weight = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        outs = torch.stack([F.relu(h @ moe.w_up[e].T).square() @ moe.w_down[e].T for e in range(8)], -1)
        want = moe.latent_out((outs * weight.unsqueeze(-2)).sum(-1)) + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)
    _, w, idx = moe.route(x)
    y = moe._gathered(h, w, idx)
    torch.testing.assert_close(moe.latent_out(y) if moe.latent_out is not None else y,
                               want - torch.sigmoid(moe.shared_gate(x)) * moe.shared(x), rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(moe, fullgraph=True)(x), want, rtol=1e-10, atol=1e-12)
        many = torch.randn(2, 9, 16, dtype=torch.float64)                  # 18 rows * 2 > 4 * 8 experts: the loop
        torch.testing.assert_close(torch.compile(moe, fullgraph=True)(many), moe(many), rtol=1e-10, atol=1e-12)
        if kind == "swiglu":
            flat = many.reshape(-1, 16)
            torch.testing.assert_close(moe(many).reshape(-1, 16), _dense_reference(moe, flat) + torch.sigmoid(
                moe.shared_gate(flat)) * moe.shared(flat), rtol=1e-10, atol=1e-12)
            other = copy.deepcopy(moe)
            other.w_up.mul_(2)
            assert int(other._op_key) != int(moe._op_key)
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(other, fullgraph=True)(many), other(many), rtol=1e-10,
                                       atol=1e-12)
            assert not torch.allclose(other(many), moe(many))
    if kind == "relu2":
        torch._dynamo.reset()
        torch.compile(moe)(many).square().sum().backward()                # training: the loop outside the graph
        assert moe.w_up.grad is not None and moe.w_up.grad.abs().sum() > 0


def test_load_balancing_loss_by_hand():
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=3, n_heads=2, pattern="gla", mlp_size=24,
                      moe={"experts": 4, "top_k": 2, "every": 1})
    model = LanguageModel(cfg).double()
    idx = torch.randint(0, 40, (2, 11))
    model(idx)
    # independently: hook each router's input, count the top-2 choices and sum the probabilities by hand
    inputs = []
    hooks = [b.mlp.router.register_forward_hook(lambda m, a, out: inputs.append(out)) for b in model.blocks]
    model(idx)
    for h in hooks:
        h.remove()
    counts, probs, rows = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), 0
    for logits in inputs:
        p = torch.softmax(logits.reshape(-1, 4), -1)
        for row in p:
            for e in row.topk(2).indices.tolist():
                counts[e] += 1
        probs += p.sum(0)
        rows += p.shape[0]
    want = 4 * ((counts / rows) * (probs / rows)).sum()
    torch.testing.assert_close(model.aux_loss(), want, rtol=1e-12, atol=0)
    assert model.aux_loss().requires_grad                   # it trains the router


def test_moe_layers_and_sizes():
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=5, n_heads=2, mlp_size=20,
                      moe={"experts": 3, "every": 2, "offset": 1})
    model = LanguageModel(cfg)
    assert cfg.moe_layers == [1, 3]
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == [False, True, False, True, False]
    assert model.blocks[1].mlp.w_gate.shape == (3, 20, 16) and model.blocks[0].mlp.w_up.weight.shape == (20, 16)
    assert cfg.moe == {"experts": 3, "top_k": 2, "every": 2, "offset": 1, "aux_loss_coef": 0.01,
                       "renormalize": False, "hidden": None, "shared": 0,
                       "shared_gate": True, "router": "softmax", "groups": 1, "topk_groups": 1, "scale": 1.0, "layers": None,
                       "renorm_eps": 1e-20}
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg      # a run config round trip


@pytest.mark.parametrize("moe,match", [
    ({"experts": 1}, "experts"), ({"experts": 4, "top_k": 5}, "top_k"), ({"experts": 4, "every": 2, "offset": 2},
                                                                          "offset"),
    ({"experts": 4, "capacity": 1.0}, "unknown moe keys"), ({"top_k": 2}, "experts"), ([4], "must be a dict"),
    ({"experts": 4, "aux_loss_coef": -1}, "aux_loss_coef")])
def test_bad_moe_options_are_refused_by_name(moe, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(moe=moe)
    with pytest.raises(ValueError, match="mlp_size"):
        ModelConfig(mlp_size=0)


def test_moe_needs_an_mlp():
    with pytest.raises(ValueError, match="mlp=True"):
        ModelConfig(mlp=False, moe={"experts": 4})


def test_a_moe_model_trains_with_the_router_loss(tmp_path):
    from subquad.data import prepare
    from subquad.train import TrainConfig, Trainer

    (tmp_path / "t.txt").write_text("".join(f"def f{i % 13}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(400)))
    data = prepare(str(tmp_path / "t.txt"), vocab_size=300, cache_dir=tmp_path / "cache", log=lambda m: None)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, pattern="mamba2,softmax", context_length=32,
                      moe={"experts": 4, "top_k": 1, "aux_loss_coef": 0.5})
    Trainer(LanguageModel(cfg), data, TrainConfig(steps=30, batch_size=4, lr=3e-3, eval_every=30),
            tmp_path / "run", progress=False).fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("aux_loss" in r for r in lines) and lines[-1]["loss"] < lines[0]["loss"] - 1.0
    assert all(0.9 <= r["aux_loss"] <= 1.5 for r in lines)   # top-1: 1 at a balanced router


def test_bf16_autocast_and_packed_sequences():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, moe={"experts": 4})
    model = LanguageModel(cfg)
    idx = torch.randint(0, 40, (1, 23))
    ref = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(idx)
    assert low.dtype == torch.bfloat16 and (low.float() - ref).abs().max() <= 0.05 * ref.abs().max()
    cu = torch.tensor([0, 9, 23])
    packed = model(idx, cu_seqlens=cu)
    torch.testing.assert_close(packed[:, 9:], model(idx[:, 9:]), rtol=1e-5, atol=1e-5)
