"""The fused Mamba-1 decoding step (ops.mamba.fused_step, kernels/mamba_step.c) against its math written out in
float64 here, and inside the layer against the layer's own PyTorch step: odd widths, batch > 1, strong decays,
both layouts of dt_proj's weight, no convolution bias, states left as they were; the kernel off or unbuildable
falls back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad import kernels
from subquad.models import LanguageModel, ModelConfig
from subquad.ops.mamba import fused_step
from tests.ops.fused_harness import assert_steps_agree, models

pytestmark = pytest.mark.skipif(not fused_step.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


def reference(xz, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, h):
    """The module doc's step, op by op in float64."""
    xz, conv_state, conv_w, wx, wdt, bdt, A_log, Dp, h = (t.double() for t in (xz, conv_state, conv_w, wx, wdt, bdt,
                                                                               A_log, Dp, h))
    D, N, R = A_log.shape[0], A_log.shape[1], wdt.shape[-1]
    heads = wx.shape[0] if wx.dim() == 3 else 1                        # Zamba: per-head wx, wdt, bdt
    wx, wdt, bdt = wx.reshape(heads, -1, D // heads), wdt.reshape(heads, D // heads, R), bdt.reshape(heads, -1)
    x, z = xz[:, :D], xz[:, D:]
    window = torch.cat([conv_state, x[:, None]], 1)                    # (B, K, D)
    u = (window * conv_w.t()[None]).sum(1) + (0 if conv_b is None else conv_b.double())
    u = F.silu(u)
    uh = u.view(-1, heads, D // heads)
    dt, Bm, Cm = torch.einsum("bhc,hjc->bhj", uh, wx).split([R, N, N], -1)      # (B, heads, .)
    dt = F.softplus(torch.einsum("bhr,hcr->bhc", dt, wdt) + bdt).reshape(-1, D)  # (B, D)
    Bm, Cm = (t.repeat_interleave(D // heads, 1) for t in (Bm, Cm))    # (B, D, N): each channel its head's
    h = torch.exp(-dt[..., None] * A_log.exp()) * h + (dt * u)[..., None] * Bm
    y = ((h * Cm).sum(-1) + Dp * u) * F.silu(z)
    return y, window[:, 1:], h


def inputs(B, D, N, R, K, g, bias=True, strong=False, heads=1):
    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    A_log = torch.log(torch.arange(1, N + 1).float()).repeat(D, 1) + (r(D, N, scale=2.0).abs() if strong else 0)
    bdt = r(D) + (4.0 if strong else -3.0)                             # strong: dt ~ 4, decays to exp(-600)
    if heads > 1:
        wx, wdt, bdt = r(heads, R + 2 * N, D // heads, scale=D ** -0.5), r(heads, D // heads, R), bdt.view(heads, -1)
    else:
        wx, wdt = r(R + 2 * N, D, scale=D ** -0.5), r(D, R, scale=R ** -0.5)
    return [r(B, 2 * D), r(B, K - 1, D), r(D, K, scale=0.5), r(D) if bias else None, wx, wdt, bdt, A_log, r(D),
            r(B, D, N)]


@pytest.mark.parametrize("B,D,N,R,K,bias,strong,column_major,heads", [
    (1, 64, 16, 4, 4, True, False, False, 1),
    (3, 37, 16, 3, 4, True, True, True, 1),       # odd width, strong decays, dt_proj column-major (decode_layout's)
    (2, 130, 5, 9, 2, False, False, True, 1),     # odd N, no bias, the shortest convolution with a state
    (5, 48, 16, 48, 3, True, True, False, 1),
    (3, 42, 16, 5, 4, True, True, False, 3),      # Zamba's heads: each its own x_proj, dt_proj and dt bias
    (16, 1040, 16, 8, 4, True, True, False, 1),   # a new state over STREAM_BYTES (1 MiB): streaming stores
    (6, 200, 16, 6, 4, True, True, True, 1),      # column-major dt_proj, rows in fours and twos, 32-channel blocks
])
def test_the_step_equals_its_math_in_float64(B, D, N, R, K, bias, strong, column_major, heads):
    g = torch.Generator().manual_seed(B * 1000 + D)
    args = inputs(B, D, N, R, K, g, bias, strong, heads)
    if column_major:
        args[5] = args[5].t().contiguous().t()
    before = [None if t is None else t.clone() for t in args]
    y, conv, h = fused_step.mamba_step(*args)
    ry, rconv, rh = reference(*args)
    for got, want in ((y, ry), (conv, rconv), (h, rh)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-30
    for a, b in zip(args, before):
        assert a is None or torch.equal(a, b)                     # the states (and weights) passed in unchanged


@pytest.mark.parametrize("B,D", [(5, 53), (16, 1040), (3, 9)])
def test_the_step_does_not_depend_on_the_threads(B, D):
    """Each thread takes a span of channels (with AVX-512 in blocks of 16, the last one shorter): the bits of
    every output are the same at 1, 2 and 3 threads - at an odd width, at a state streamed past STREAM_BYTES, and
    at fewer channels than a block."""
    args = inputs(B, D, 16, 4, 4, torch.Generator().manual_seed(7), strong=True)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(fused_step.mamba_step(*args))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("D,column_major", [(37, False), (150, True)])
def test_a_row_does_not_depend_on_the_rows_beside_it(D, column_major):
    """With AVX-512 each row's x_proj sums, dt (either layout of dt_proj), scan and gate are its own (the same
    order at any batch): a row's outputs alone equal its outputs in a batch of 5, bit for bit; without it (the
    AVX2 dot products group rows in fours) within float32 rounding."""
    args = inputs(5, D, 16, 3, 4, torch.Generator().manual_seed(3), strong=True)
    if column_major:
        args[5] = args[5].t().contiguous().t()
    batch = fused_step.mamba_step(*args)
    exact = "avx512f" in kernels.cpuinfo().split()
    for b in range(5):
        one = [a[b:b + 1] if i in (0, 1, 9) else a for i, a in enumerate(args)]     # xz, conv state, ssm state
        for got, want in zip(fused_step.mamba_step(*one), batch):
            if exact:
                assert torch.equal(got[0], want[b])
            else:
                assert torch.allclose(got[0], want[b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [1, 4])
def test_the_layer_takes_it_and_agrees_with_its_own_step(monkeypatch, heads):
    """Decoding steps of a Mamba model (batch 3, odd prompt; Zamba's heads too): the kernel's logits within float32
    rounding of the layer's PyTorch step and of a float64 copy; the greedy continuation identical; the kernel was
    called. (Norms with a bias: elsewhere the block's kernel runs the mixer's half, test_mamba_fused_block.py.)"""
    m, m64 = models(d_model=48, n_layers=3, pattern="mamba,softmax,mamba", mixer_options={"mamba": {"heads": heads}},
                    mlp=True, norm_bias=True)
    assert assert_steps_agree(monkeypatch, fused_step, m, m64, 4, prompt=11) == 4 * 2     # two Mamba layers
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("SUBQUAD_KERNELS", "1")
    with_kernel = m.generate(ids[0].tolist(), 16, temperature=0)[0]
    monkeypatch.setenv("SUBQUAD_KERNELS", "0")
    assert with_kernel == m.generate(ids[0].tolist(), 16, temperature=0)[0]


def test_where_it_is_not_taken(monkeypatch):
    """Gradients, autocast, float64, Falcon-Mamba's norms and a prompt keep the PyTorch path."""
    m, _ = models(d_model=48, n_layers=3, pattern="mamba")
    x = torch.randn(2, 1, 48)
    st = m.blocks[0].mixer.empty_state(2)

    def usable(x):
        return kernels.usable(fused_step.KERNEL, x)

    assert not usable(x)                               # gradients on (pytest's default)
    with torch.no_grad():
        assert usable(x)
        assert not usable(torch.randn(2, 3, 48)) and not usable(x.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not usable(x)
        monkeypatch.setenv("SUBQUAD_KERNELS", "0")
        assert not usable(x)
    calls = []
    monkeypatch.setenv("SUBQUAD_KERNELS", "1")
    monkeypatch.setattr(fused_step, "_run", lambda *a: calls.append(1))
    torch.manual_seed(0)
    falcon = LanguageModel(ModelConfig(vocab_size=300, d_model=48, n_layers=1, pattern="mamba", mlp=False,
                                       mixer_options={"mamba": {"bcdt_rms_eps": 1e-6}})).eval()
    with torch.no_grad():
        falcon.step(torch.tensor([1, 2]), falcon.empty_state(2))
    assert not calls and st["ssm"].abs().sum() == 0


def test_a_kernel_that_cannot_be_built_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="'mamba_step' is not available"):
            assert kernels.load("mamba_step") is None
    finally:
        kernels.load.cache_clear()
    monkeypatch.delenv("CC")
    assert kernels.load("mamba_step") is not None and list((tmp_path / "kernels").glob("mamba_step-*.so"))
    kernels.load.cache_clear()
