"""Normalisations: GatedRMSNorm against its formula, and Mamba-2's folded output projection."""

import pytest
import torch

from subquad.layers import GatedRMSNorm, Mamba2
from tests.ops.harness import assert_close

F64 = torch.float64


def gated_rmsnorm(y, z, weight, group, eps):
    g = y * z * torch.sigmoid(z)
    gg = g.reshape(*g.shape[:-1], -1, group)
    gg = gg / torch.sqrt((gg ** 2).mean(-1, keepdim=True) + eps)
    return gg.reshape(g.shape) * weight


@pytest.mark.parametrize("group", [None, 4])
@pytest.mark.parametrize("grad", [False, True])
def test_gated_rmsnorm_equals_its_formula(group, grad):
    gen = torch.Generator().manual_seed(1)
    norm = GatedRMSNorm(12, eps=1e-5, group_size=group).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen, dtype=F64))
    y, z = (torch.randn(2, 7, 12, generator=gen, dtype=F64).requires_grad_(grad) for _ in range(2))
    out = norm(y, z)
    ref = gated_rmsnorm(y, z, norm.weight, group or 12, 1e-5)
    assert_close(out, ref, 1e-12, "gated rmsnorm")
    if grad:
        dy = torch.randn(out.shape, generator=gen, dtype=F64)
        for a, b in zip(torch.autograd.grad((out * dy).sum(), (y, z, norm.weight)),
                        torch.autograd.grad((ref * dy).sum(), (y, z, norm.weight))):
            assert_close(a, b, 1e-10, "gradient")


@pytest.mark.parametrize("grad", [False, True])
def test_mamba2_folded_output_projection_equals_out_proj_of_the_norm(grad):
    gen = torch.Generator().manual_seed(2)
    m = Mamba2(16, d_state=4, head_dim=8).double()
    with torch.no_grad():
        m.norm.weight.copy_(torch.randn(m.d_inner, generator=gen, dtype=F64))
    y, z = (torch.randn(3, 5, m.d_inner, generator=gen, dtype=F64).requires_grad_(grad) for _ in range(2))
    with torch.set_grad_enabled(grad):
        out, ref = m.project_out(y, z), m.out_proj(m.norm(y, z))
    assert_close(out, ref, 1e-12, "folded")
    if grad:
        dy = torch.randn(out.shape, generator=gen, dtype=F64)
        wrt = (y, z, m.norm.weight, m.out_proj.weight)
        for a, b in zip(torch.autograd.grad((out * dy).sum(), wrt), torch.autograd.grad((ref * dy).sum(), wrt)):
            assert_close(a, b, 1e-10, "gradient")
