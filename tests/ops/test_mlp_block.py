"""The fused MLP half of a pre-norm block (ops.mlp_block, kernels/mlp_block.c; layers.mlp_step keeps it) against its
math written out in float64 here, and inside hybrid models against the blocks' own PyTorch forward and a float64
copy: odd widths, biases, either weight layout, 1 to 16 rows, quantised projections, weights changed between
tokens, hooks, autocast."""

from __future__ import annotations

import pytest
import torch

from subquad.layers import mlp_step
from subquad.models import stack
from subquad.ops import mlp_block
from tests.ops.fused_harness import assert_steps_agree, count_calls, models, step_logits

pytestmark = pytest.mark.skipif(not mlp_block.KERNEL.available(), reason="no C compiler: the kernel cannot be built")

HYBRID = dict(d_model=64, n_layers=3, pattern="mamba2,softmax,mamba2", mlp=True, mlp_size=96, n_heads=4,
              mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})


@pytest.mark.parametrize("B,d,F,bias,cm,act", [(1, 40, 64, False, (False, False, False), mlp_block.SWIGLU),
                                               (3, 29, 37, True, (True, False, True), mlp_block.SWIGLU),
                                               (16, 33, 96, True, (False, True, False), mlp_block.SWIGLU),
                                               (3, 29, 37, True, (False, True, True), mlp_block.RELU2)])
def test_the_mlp_equals_its_math_in_float64(B, d, F, bias, cm, act):
    """SwiGLU and the ungated ReLU^2: odd sizes, column-major weights, biases, 1 to 16 rows."""
    g = torch.Generator().manual_seed(B * 100 + d)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    h, norm_w = r(B, 1, d, scale=3.0), torch.rand(d, generator=g) + 0.5
    ws = [r(F, d, scale=d ** -0.5), r(F, d, scale=d ** -0.5), r(d, F, scale=F ** -0.5)]
    ws = [w.T.contiguous().T if c else w for w, c in zip(ws, cm)]
    bs = [r(F), r(F), r(d)] if bias else [None] * 3
    before = [t.clone() for t in [h, norm_w, *ws] + [b for b in bs if b is not None]]

    hd = h.double()[:, 0]
    x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()

    def lin(v, w, b):
        return v @ w.double().T + (0 if b is None else b.double())
    a, u = lin(x, ws[0], bs[0]), lin(x, ws[1], bs[1])
    want = hd + lin(a * torch.sigmoid(a) * u if act == mlp_block.SWIGLU else u.clamp_min(0) ** 2, ws[2], bs[2])

    pairs = list(zip(ws, bs))
    with torch.no_grad():
        got = mlp_block.mlp_block(h, norm_w, 1e-5, (None, None) if act else pairs[0], *pairs[1:], act=act)
    assert got.dtype == torch.float32 and got.shape == (B, 1, d)
    assert (got[:, 0].double() - want).abs().max() <= 1e-5 * want.abs().max()
    for t, b in zip([h, norm_w, *ws] + [b for b in bs if b is not None], before):
        assert torch.equal(t, b)                                     # nothing passed in is written


def counted(monkeypatch):
    return count_calls(monkeypatch, mlp_block.MlpStep)


@pytest.mark.parametrize("kind", ["swiglu", "relu2"])
def test_a_hybrids_mlps_take_it_and_agree_with_the_modules_and_float64(monkeypatch, kind):
    """Each block's MLP at each token (3 layers, 4 steps), the attention layer's too, SwiGLU and ReLU^2
    (Nemotron-H's): in float32 within 1e-5 of the PyTorch step and of a float64 model's."""
    monkeypatch.setattr(stack, "ENABLED", False)
    m, m64 = models(**HYBRID, mlp_kind=kind)
    calls = counted(monkeypatch)
    assert_steps_agree(monkeypatch, mlp_step, m, m64, 4, fn="fused_mlp")
    assert len(calls) == 3 * 4


def test_a_parallel_blocks_mlp_takes_it(monkeypatch):
    """Falcon-H1's block (Mamba-2 beside attention on one normed input, then the MLP): the MLP half takes the
    call too, within 1e-5 of the PyTorch step and of a float64 model's."""
    monkeypatch.setattr(stack, "ENABLED", False)
    m, m64 = models(d_model=64, n_layers=2, pattern="mamba2", parallel={"mamba2": "softmax"}, mlp=True,
                    mlp_size=96, n_heads=4, mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})
    calls = counted(monkeypatch)
    assert_steps_agree(monkeypatch, mlp_step, m, m64, 3, fn="fused_mlp")
    assert len(calls) == 2 * 3


@pytest.mark.parametrize("kind,tol", [("int8", 2e-2), ("int4", 6e-2)])
def test_quantised_mlps_agree_with_the_modules(monkeypatch, kind, tol):
    """int8 per channel (x rounded per block of 32 in the kernel) and int4 MLPs: the logits within ``tol`` of the
    logits' scale of the same model's steps with the MLP's modules (their products as the quantised modules take
    them one by one)."""
    from subquad.models.quant import quantize

    monkeypatch.setattr(stack, "ENABLED", False)
    m, _ = models(**dict(HYBRID, mlp_size=128))
    quantize(m, kind, group_size=32) if kind == "int4" else quantize(m, kind)
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])

    a = step_logits(m, ids, tok)
    assert len(calls) == 3
    monkeypatch.setattr(mlp_step, "fits", lambda mlp, norm: False)      # the modules
    b = step_logits(m, ids, tok)
    assert len(calls) == 3
    assert (a - b).abs().max() <= tol * b.abs().max()


def test_the_call_is_kept_and_sees_every_change(monkeypatch):
    """Built once per rows, then only called; a weight replaced between tokens (``.data =``, a new module) is read
    at the next token; a hook on the MLP runs the module (and the hook); bf16 autocast and gradients take the
    modules."""
    monkeypatch.setattr(stack, "ENABLED", False)
    m, _ = models(**HYBRID)
    ids, tok = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])
    built, make = [], mlp_step.build
    monkeypatch.setattr(mlp_step, "build", lambda *a: built.append(1) or make(*a))
    calls = counted(monkeypatch)

    def step(enabled=True):
        monkeypatch.setenv("SUBQUAD_KERNELS", "1" if enabled else "0")
        with torch.no_grad():
            _, st = m.prefill(ids)
            return m.step(tok, st)[0]
    first = step()
    assert len(built) == 3 and len(calls) == 3
    assert torch.equal(step(), first) and len(built) == 3 and len(calls) == 6
    mlp = m.blocks[0].mlp
    mlp.w_up.weight.data = mlp.w_up.weight.data * 2                  # read at the next token
    changed = step()
    assert len(built) == 4 and (changed - step(False)).abs().max() <= 1e-5 * changed.abs().max()
    assert (changed - first).abs().max() > 1e-3
    mlp.w_down = torch.nn.Linear(96, 64, bias=True)                  # a new module, with a bias
    changed = step()
    assert len(built) == 5 and (changed - step(False)).abs().max() <= 1e-5 * changed.abs().max()
    seen = []
    handle = mlp.register_forward_hook(lambda *a: seen.append(1))
    n = len(calls)
    step()
    assert seen == [1, 1] and len(calls) == n + 2          # prefill and step; the other two MLPs still take it
    handle.remove()
    n = len(calls)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, st = m.prefill(ids)
        m.step(tok, st)
    _, st = m.prefill(ids)
    m.step(tok, st)                                                   # gradients on
    assert len(calls) == n


def test_quantize_forgets_the_kept_calls(monkeypatch):
    """``quantize`` replaces the weights: the MLPs' and attention layer's kept calls go with the old ones
    (``layers.mamba.forget_block_steps``), not held until the next token finds them stale."""
    from subquad.layers import attention_step
    from subquad.models.quant import quantize

    monkeypatch.setattr(stack, "ENABLED", False)
    m, _ = models(**HYBRID)
    with torch.no_grad():
        _, st = m.prefill(torch.tensor([[1, 2, 3]]))
        m.step(torch.tensor([4]), st)
    mlps, attn = [b.mlp for b in m.blocks], m.blocks[1].mixer
    assert all(mlp_step._PLANS.by.get(mlp) for mlp in mlps) and attention_step._PLANS.by.get(attn)
    quantize(m, "int8")
    assert not any(mlp in mlp_step._PLANS.by for mlp in mlps) and attn not in attention_step._PLANS.by
