"""The fused pre-norm Mamba-2 block (ops.decay.fused_block, kernels/mamba2_block.c) against its math written out in
float64 here (the norm, both products in either layout, the layer's step as test_mamba2_fused_step's reference
has it, the residual), and inside a model against the blocks' own PyTorch forward and a float64 copy: groups of
heads, norm groups, no norm, a dt limit, odd sizes, batch > 1."""

from __future__ import annotations

import pytest
import torch

from subquad.kernels import qgemv
from subquad.models import stack
from subquad.ops.decay import fused_block, fused_step
from tests.ops.fused_harness import assert_quantized_block_agrees, assert_steps_agree, models
from tests.ops.test_mamba2_fused_step import reference


@pytest.fixture(autouse=True)
def blocks_one_by_one(monkeypatch):
    """These tests hold each block's own call (and count it); tests/models/test_stack.py the blocks in one."""
    monkeypatch.setattr(stack, "ENABLED", False)


pytestmark = pytest.mark.skipif(not fused_block.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


@pytest.mark.parametrize("B,d,H,P,N,G,K,norm_groups,bias,limit,cm", [
    (1, 40, 4, 16, 16, 1, 4, 1, True, (0.0, float("inf")), (False, False)),
    (3, 29, 6, 5, 7, 3, 4, 2, False, (0.0, float("inf")), (True, False)),   # odd sizes, groups, 2 norm groups
    (16, 33, 4, 8, 16, 2, 2, 0, True, (0.01, 0.3), (False, True)),          # no norm, a dt limit, 16 rows
])
def test_the_block_equals_its_math_in_float64(B, d, H, P, N, G, K, norm_groups, bias, limit, cm):
    g = torch.Generator().manual_seed(B * 100 + d)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    Dn, C = H * P, H * P + 2 * G * N
    W = 2 * Dn + 2 * G * N + H
    h, norm_w = r(B, 1, d, scale=3.0), torch.rand(d, generator=g) + 0.5
    w_in, w_out = r(W, d, scale=d ** -0.5), r(d, Dn, scale=Dn ** -0.5)
    w_in, w_out = (w.T.contiguous().T if c else w for w, c in zip((w_in, w_out), cm))
    b_in, b_out = (r(W), r(d)) if bias else (None, None)
    layer = [r(B, K - 1, C), r(C, K, scale=0.5), r(C) if bias else None, r(H) - 2.0, r(H).abs(), r(H),
             r(B, H, N, P), r(Dn).abs() + 0.5 if norm_groups else None, G, Dn // max(norm_groups, 1), 1e-5]
    args = [h, norm_w, 1e-5, w_in, b_in, w_out, b_out, *layer, limit]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    hd = h.double()[:, 0]
    x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    zxbcdt = (x @ w_in.double().T + (0 if b_in is None else b_in.double())).float()   # reference() takes float32
    y, conv_want, S_want = reference(zxbcdt, *layer, *limit)
    h_want = hd + y @ w_out.double().T + (0 if b_out is None else b_out.double())

    with torch.no_grad():
        h_got, conv_got, S_got = fused_block.block_step(*args)
    for got, want in ((h_got[:, 0], h_want), (conv_got, conv_want), (S_got, S_want)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-30
    for a, b in zip(args, before):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)    # the states (and weights) passed in unchanged


@pytest.mark.parametrize("T,B,d,H,P,N,G,K,norm_groups,limit,cm", [
    (8, 1, 40, 4, 16, 16, 1, 4, 1, (0.0, float("inf")), (False, False)),    # a verification of 8 tokens, 1 row
    (3, 5, 29, 6, 5, 7, 3, 4, 2, (0.0, float("inf")), (True, False)),       # odd sizes, groups, 2 norm groups
    (4, 4, 33, 4, 64, 16, 2, 2, 0, (0.01, 0.3), (False, True)),             # P 64 (whole lines), no norm, a limit
])
def test_tokens_equal_the_math_token_by_token_in_float64(T, B, d, H, P, N, G, K, norm_groups, limit, cm):
    """``TokensStep``: T tokens of B rows in one call equal the block's math in float64 run token by token from the
    state each token leaves - every token's h', conv state and S (the states a verification keeps)."""
    g = torch.Generator().manual_seed(T * 100 + B)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    Dn, C = H * P, H * P + 2 * G * N
    W = 2 * Dn + 2 * G * N + H
    h, norm_w = r(B, T, d, scale=3.0), torch.rand(d, generator=g) + 0.5
    w_in, w_out = r(W, d, scale=d ** -0.5), r(d, Dn, scale=Dn ** -0.5)
    w_in, w_out = (w.T.contiguous().T if c else w for w, c in zip((w_in, w_out), cm))
    b_in, b_out = r(W), r(d)
    conv_state, S = r(B, K - 1, C), r(B, H, N, P)
    fixed = [r(C, K, scale=0.5), r(C), r(H) - 2.0, r(H).abs(), r(H)]                    # conv w, b, dt bias, A_log, D
    gnorm = [r(Dn).abs() + 0.5 if norm_groups else None, G, Dn // max(norm_groups, 1), 1e-5]
    before = [t.clone() for t in (h, conv_state, S)]
    step = fused_block.TokensStep(T, B, norm_w, 1e-5, w_in, b_in, w_out, b_out, *fixed[:3], fixed[3], fixed[4],
                                  gnorm[0], Dn, N, G, gnorm[2], gnorm[3], limit)
    with torch.no_grad():
        h_got, conv_got, S_got = step(h, conv_state, S)
    assert h_got.shape == (B, T, d) and conv_got.shape == (B, T, K - 1, C) and S_got.shape == (B, T, H, N, P)
    conv, s = conv_state, S
    for t in range(T):
        hd = h[:, t].double()
        x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
        zxbcdt = (x @ w_in.double().T + b_in.double()).float()                          # reference() takes float32
        y, conv, s = reference(zxbcdt, conv, fixed[0], fixed[1], fixed[2], fixed[3], fixed[4], s, *gnorm, *limit)
        h_want = hd + y @ w_out.double().T + b_out.double()
        for got, want in ((h_got[:, t], h_want), (conv_got[:, t], conv), (S_got[:, t], s)):
            assert got.dtype == torch.float32
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max() + 1e-30, t
    for a, b in zip((h, conv_state, S), before):
        assert torch.equal(a, b)                                         # the inputs passed in unchanged


@pytest.mark.parametrize("options", [{"n_groups": 2, "d_state": 16, "head_dim": 8},
                                     {"gated_norm": False, "dt_limit": (0.01, 0.2)}])
def test_a_model_without_mlps_takes_it_and_agrees_with_its_blocks(monkeypatch, options):
    """mamba2-130m's structure (pre-norm Mamba-2 blocks, no MLP) with a softmax layer, batch 3: the block kernel's
    logits within float32 rounding of the blocks' PyTorch forward and a float64 copy's; the layer's own kernel
    unused."""
    m, m64 = models(d_model=64, n_layers=3, pattern="mamba2,softmax,mamba2", mixer_options={"mamba2": options})
    step_calls = []
    monkeypatch.setattr(fused_step, "_run", lambda *a: step_calls.append(1))
    assert assert_steps_agree(monkeypatch, fused_block.BlockStep, m, m64, 3, fn="__call__") == 3 * 2
    assert not step_calls


@pytest.mark.parametrize("mlp_kind", ["swiglu", "relu2"])
def test_blocks_with_an_mlp_take_it_for_the_mixers_half(monkeypatch, mlp_kind):
    """Bamba's and Granite 4's structure (a SwiGLU MLP after each Mamba-2 mixer; Nemotron-H's squared ReLU), with a
    softmax layer: the mixer's half (norm, mixer, residual) in one call, then the MLP's modules - logits within
    float32 rounding of the blocks' PyTorch forward and a float64 copy's, once per Mamba-2 layer and step."""
    m, m64 = models(d_model=64, n_layers=3, pattern="mamba2,softmax,mamba2", mlp=True, mlp_kind=mlp_kind,
                    mixer_options={"mamba2": {"n_groups": 2, "d_state": 16, "head_dim": 8}})
    step_calls = []
    monkeypatch.setattr(fused_step, "_run", lambda *a: step_calls.append(1))
    assert assert_steps_agree(monkeypatch, fused_block.BlockStep, m, m64, 3, fn="__call__") == 3 * 2
    assert not step_calls


@pytest.mark.parametrize("kind,tol", [("int8", 5e-2), ("int4", 0.15), ("int8 blocks", 5e-2),
                                      ("int8 blocks of 16", 1e-5), ("q4_0", 5e-2), ("bf16", 1e-2),
                                      ("f16", 1e-5)])
def test_quantized_projections_take_it_for_a_few_rows(monkeypatch, kind, tol):
    """int8 (per channel) and int4 in_proj and out_proj, x rounded per block of 32 inside the kernel as their
    modules' products round it, bfloat16 (x rounded to bfloat16; where the CPU has the kernel), float16 (x exact),
    and int8 per block (a GGUF Q8_0 file's, x exact): the block in one call agrees with its modules and with a
    float64 copy of the dequantised weights (fused_harness)."""
    from subquad.layers.mamba2 import Mamba2

    if kind == "bf16" and not qgemv.bf16() or kind == "f16" and not qgemv.f16():
        pytest.skip(f"no kernel for {kind} here: its blocks run as modules")
    assert assert_quantized_block_agrees(monkeypatch, fused_block, Mamba2, "mamba2", kind, tol) == 2 * 3 * 3
