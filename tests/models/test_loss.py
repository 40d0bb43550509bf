"""The chunked head + cross-entropy (models/loss.py, LanguageModel(idx, targets=...)) equals the materialised
logits' F.cross_entropy, value and gradients, in float64; in bf16 autocast it stays within bf16's rounding."""

import pytest
import torch
import torch.nn.functional as F

from subquad.models import LanguageModel, ModelConfig
from subquad.models.loss import linear_cross_entropy
from tests.ops.harness import assert_close

F64 = torch.float64


def inputs(seed=0, B=2, T=23, D=8, vocab=11):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(vocab, D, generator=g, dtype=F64, requires_grad=True)
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, 3] = -100
    y[1, :5] = -100                                   # ignored targets, as packing leaves them
    return h, W, y


@pytest.mark.parametrize("chunk", [None, 1, 7, 46, 100])
def test_equals_cross_entropy_of_the_logits_with_gradients(chunk):
    h, W, y = inputs()
    ref = F.cross_entropy((h @ W.T).flatten(0, 1), y.flatten(), ignore_index=-100)
    got = linear_cross_entropy(h, W, y, chunk=chunk)
    assert_close(got, ref, 1e-13, "loss")
    for a, b in zip(torch.autograd.grad(got * 1.7, [h, W]), torch.autograd.grad(ref * 1.7, [h, W])):
        assert_close(a, b, 1e-12, "gradient")


def test_bf16_autocast_stays_within_bf16_rounding():
    h, W, y = inputs(seed=1)
    ref = F.cross_entropy((h @ W.T).flatten(0, 1), y.flatten())
    gh, gW = torch.autograd.grad(ref, [h, W])
    hf, Wf = h.detach().float().requires_grad_(), W.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hf, Wf, y, chunk=7)
    loss.backward()
    assert loss.dtype == torch.float32 and hf.grad.dtype == torch.float32 and Wf.grad.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 0.02 * abs(ref.item())
    assert (hf.grad.double() - gh).abs().max() < 0.02 * gh.abs().max()
    assert (Wf.grad.double() - gW).abs().max() < 0.02 * gW.abs().max()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_model_loss_equals_cross_entropy_of_its_logits(tie, packed):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, context_length=32, pattern="gla,softmax",
                      tie_embeddings=tie)
    model = LanguageModel(cfg).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 50, (1 if packed else 2, 21), generator=g), torch.randint(0, 50, (1 if packed else 2, 21), generator=g)
    y[0, :4] = -100
    kw = {"cu_seqlens": torch.tensor([0, 5, 14, 21])} if packed else {}
    logits = model(x, **kw)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    got = model(x, targets=y, **kw)
    assert_close(got, ref, 1e-12, "loss")
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
        assert_close(a, b, 1e-10, "parameter gradient")


def test_bad_arguments_are_refused_by_name():
    h, W, y = inputs()
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, W, y[:, :-1])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, W.T, y)
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(h, W, y, chunk=0)
    for bad in (W.shape[0], -3):                       # outside the vocabulary (-100, ignore_index, is skipped)
        with pytest.raises(ValueError, match=f"targets must be token ids in \\[0, {W.shape[0]}\\).*got {bad}"):
            linear_cross_entropy(h, W, torch.where(y == y[0, 0], bad, y))


def test_model_loss_under_torch_compile_equals_eager():
    # the trainer calls model(x, targets=y); compiled (aot_eager, as the precision matrix), it equals eager
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, context_length=32,
                                      pattern="gla,softmax"))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 50, (2, 19), generator=g), torch.randint(0, 50, (2, 19), generator=g)
    runs = []
    for m in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        loss = m(x, targets=y)
        loss.backward()
        runs.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
