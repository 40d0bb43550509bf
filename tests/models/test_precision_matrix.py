"""Every mixer name usable in a pattern, in every precision people train in, on the meta device and under
torch.compile: a 2-layer LM's forward + backward + one AdamW step is finite, its loss is close to the float32
model's (computed separately, same weights and batch), and its output has the documented dtype."""

import pytest
import torch
import torch.nn.functional as F

from subquad.layers import MIXERS
from subquad.models import LanguageModel, ModelConfig

NAMES = sorted(MIXERS) + ["linear+conv", "retention+conv", "gla+conv"]     # + the short-convolution option


def model_and_batch(name, seed=0):
    torch.manual_seed(seed)
    options = {}
    if name.endswith("+conv"):
        name = name[:-5]
        options = {name: {"conv_size": 4}}
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, context_length=64, pattern=name,
                      mixer_options=options)
    model = LanguageModel(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, 64, (2, 37), generator=g)              # odd length, batch > 1
    return model, idx[:, :-1], idx[:, 1:]


def step(model, x, y, precision):
    """loss (float), logits dtype, after forward + backward + one AdamW step."""
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    elif precision == "float64":
        model = model.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    weights_finite = all(torch.isfinite(p).all() for p in model.parameters())
    return float(loss.detach()), logits.dtype, grads_finite and weights_finite


EXPECTED_DTYPE = {"float32": torch.float32, "bf16_autocast": torch.bfloat16, "bf16_weights": torch.bfloat16,
                  "float64": torch.float64}
TOLERANCE = {"float32": 1e-6, "bf16_autocast": 0.02, "bf16_weights": 0.02, "float64": 1e-5}


@pytest.mark.parametrize("precision", ["bf16_autocast", "bf16_weights", "float64"])
@pytest.mark.parametrize("name", NAMES)
def test_every_mixer_trains_in_every_precision(name, precision):
    model, x, y = model_and_batch(name)
    ref, ref_dtype, _ = step(model_and_batch(name)[0], x, y, "float32")
    assert ref_dtype == torch.float32
    loss, dtype, finite = step(model, x, y, precision)
    assert finite, f"{name} in {precision}: a gradient or weight is not finite"
    assert dtype == EXPECTED_DTYPE[precision], f"{name} in {precision} returned {dtype}"
    assert abs(loss - ref) <= TOLERANCE[precision] * abs(ref), f"{name} {precision}: {loss} vs float32 {ref}"


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_returns_the_documented_dtype(name):
    """Outside autocast a layer returns its input's dtype; under autocast, autocast's (as nn.Linear does)."""
    model, x, _ = model_and_batch(name)
    layer = model.blocks[0].mixer
    h = torch.randn(2, 9, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(h)
    assert y.dtype == torch.bfloat16
    y, _ = layer.to(torch.float64)(h.double())
    assert y.dtype == torch.float64


@pytest.mark.parametrize("name", NAMES)
def test_forward_on_the_meta_device(name):
    model, x, _ = model_and_batch(name)
    model = model.to("meta")
    logits = model(x.to("meta"))
    assert logits.device.type == "meta" and logits.shape == (2, 36, 64)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_model_equals_eager_training_and_without_gradient(name):
    """torch.compile traces every mixer (aot_eager: dynamo's graph capture and AOT autograd without a C++
    toolchain; benchmarks/bench_precision.py runs inductor): the training step's loss and gradients and
    the no-gradient forward equal eager to 1e-5 relative."""
    torch._dynamo.reset()
    model, x, y = model_and_batch(name)
    compiled = torch.compile(model, backend="aot_eager")

    def loss_and_grads(m):
        model.zero_grad(set_to_none=True)
        logits = m(x)
        loss = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
        loss.backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager_logits, eager_grads = loss_and_grads(model)
    comp_logits, comp_grads = loss_and_grads(compiled)
    torch.testing.assert_close(comp_logits, eager_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(comp_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
