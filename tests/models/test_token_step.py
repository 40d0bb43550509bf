"""models.token_step: a decoding token's embedding, blocks (one C call a run) and final norm + head (one C call)
against the prefill's path (``ENABLED`` off) and a float64 model; what keeps the prefill's path; a weight changed
between tokens is read."""

from __future__ import annotations

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models import token_step
from subquad.models.quant import quantize
from tests.models.test_stack import assert_near_float64, steps
from tests.ops.fused_harness import count_calls, models

pytestmark = pytest.mark.skipif(not token_step.KERNEL.available(), reason="no C compiler: the kernel cannot be built")

SHAPES = {"mamba, tied head": dict(d_model=64, n_layers=3, pattern="mamba"),
          "hybrid, own head": dict(d_model=64, n_layers=4, pattern="mamba2,softmax,mamba2,mamba2", mlp=True,
                                   mlp_size=96, n_heads=4, n_kv_heads=2, tie_embeddings=False,
                                   mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})}


def counted(monkeypatch):
    return count_calls(monkeypatch, token_step.HeadStep)


def decode(m, ids, tok, n, enabled, monkeypatch):
    return steps(m, ids, tok, n, enabled, monkeypatch, module=token_step)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("precision", ["float32", "int8", "int4", "bf16"])
def test_the_token_in_three_steps_agrees_with_the_prefills_path_and_float64(monkeypatch, name, precision):
    m, m64 = models(**SHAPES[name])
    if precision != "float32":
        quantize(m, precision, group_size=32) if precision == "int4" else quantize(m, precision)
    ids = torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(0))
    tok = torch.tensor([5, 50, 250])
    calls = counted(monkeypatch)
    fast = decode(m, ids, tok, 5, True, monkeypatch)
    # every token (the first runs the blocks one by one inside it); a bf16 head where the CPU has the kernel
    assert len(calls) == (5 if precision != "bf16" or qgemv.bf16() else 0)
    ref = decode(m, ids, tok, 5, False, monkeypatch)
    tol = 1e-5 if precision == "float32" else 1e-4  # x rounded in both paths alike: the same products
    for (a, sa), (b, sb) in zip(fast, ref):
        assert a.shape == b.shape == (3, 300)
        assert (a - b).abs().max() <= tol * b.abs().max()
        assert sa.pos == sb.pos
    if precision == "float32":
        assert_near_float64(m64, ids, tok, fast)


def test_what_keeps_the_prefills_path(monkeypatch):
    """Hooks on the head, the norm or the embedding run (the prefill's path); a logit cap, gradients, more rows
    than the kernels take, a model without a run of blocks keep it too; a head weight replaced between tokens is
    read at the next."""
    m, _ = models(**SHAPES["hybrid, own head"])
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (1, 4), generator=torch.Generator().manual_seed(1)), torch.tensor([9])
    decode(m, ids, tok, 3, True, monkeypatch)
    assert len(calls) == 3
    for mod in (m.head, m.norm, m.embed):
        calls.clear()
        seen = []
        handle = mod.register_forward_hook(lambda *a: seen.append(1))
        decode(m, ids, tok, 3, True, monkeypatch)
        handle.remove()
        assert not calls and len(seen) == 4
    calls.clear()
    m.config.logit_soft_cap = 30.0
    decode(m, ids, tok, 3, True, monkeypatch)
    m.config.logit_soft_cap = None
    assert not calls
    with torch.no_grad():
        _, st = m.prefill(torch.randint(0, 300, (17, 3)))
        m.step(torch.zeros(17, dtype=torch.long), st)
    _, st = m.prefill(ids)
    m.step(tok, st)
    assert not calls
    with torch.no_grad():
        _, st = m.prefill(ids)
        _, st = m.step(tok, st)
        a, _ = m.step(tok, st)
        m.head.weight.data = m.head.weight.data * 2
        b, _ = m.step(tok, st)
        monkeypatch.setattr(token_step, "ENABLED", False)
        c, _ = m.step(tok, st)
    assert len(calls) == 3 and not torch.allclose(a, b) and (b - c).abs().max() <= 1e-5 * c.abs().max()
    calls.clear()
    apart, _ = models(d_model=64, n_layers=2, pattern="mamba,softmax")     # no run of blocks: the prefill's path
    decode(apart, ids, tok, 2, True, monkeypatch)
    assert not calls
