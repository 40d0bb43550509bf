"""The selective scan of whole prompts in C (ops.mamba.fused_scan, kernels/mamba_scan.c) against the scan written
out token by token in float64 here: odd lengths and widths (channel blocks with tails), batch > 1, strong decays
(dt A far below exp's underflow), inputs read through strides (in_proj's and x_proj's split outputs), with and
without D, z and a starting state, inputs left as they were; ``selective_scan`` takes it for a float32 prefill
(packed prompts too) and keeps the chunked form under gradients, in float64, while compiling and with kernels
off; a Mamba model's prefill then equals its own step-by-step decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from subquad.models import LanguageModel, ModelConfig
from subquad.ops import selective_scan
from subquad.ops.mamba import fused_scan
from tests.ops.harness import count_calls

pytestmark = pytest.mark.skipif(not fused_scan.KERNEL.available(), reason="no C compiler: the kernel cannot be built")


def reference(x, dt, A, B, C, D=None, z=None, h=None):
    """The module doc's scan in float64, one token at a time."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    Bz, T, Dm = x.shape
    h = x.new_zeros(Bz, Dm, A.shape[1]) if h is None else h.double()
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        y = (h * C[:, t, None, :]).sum(-1) + (0 if D is None else D.double() * x[:, t])
        ys.append(y if z is None else y * F.silu(z[:, t].double()))
    return torch.stack(ys, 1), h


def inputs(Bz, T, Dm, N, strong=False, seed=0):
    """x, dt, A, B, C, D, z, h0; B, C as x_proj's output split (token stride R + 2N), z as in_proj's second half."""
    g = torch.Generator().manual_seed(seed)
    xz = torch.randn(Bz, T, 2 * Dm, generator=g)
    x, z = xz[..., :Dm], xz[..., Dm:]
    dt = torch.rand(Bz, T, Dm, generator=g) * (8.0 if strong else 0.5)
    A = -torch.rand(Dm, N, generator=g) * (30.0 if strong else 2.0) - 0.1           # strong: dt A down to -240
    _, B, C = torch.randn(Bz, T, 3 + 2 * N, generator=g).split([3, N, N], -1)
    return x, dt, A, B, C, torch.randn(Dm, generator=g), z, torch.randn(Bz, Dm, N, generator=g)


@pytest.mark.parametrize("Bz,T,Dm,N,strong", [(1, 1, 8, 4, False), (2, 37, 50, 16, False), (3, 130, 33, 7, True),
                                              (1, 64, 96, 16, True)])
@pytest.mark.parametrize("parts", ["all", "bare"])
def test_the_kernel_equals_the_scan_written_out(Bz, T, Dm, N, strong, parts):
    x, dt, A, B, C, D, z, h0 = inputs(Bz, T, Dm, N, strong)
    if parts == "bare":
        D = z = h0 = None
    assert x.stride(-1) == 1 and x.stride(1) == 2 * Dm and B.stride(1) == 3 + 2 * N       # read through strides
    before = [t.clone() for t in (x, dt, A, B, C, D, z, h0) if t is not None]
    assert fused_scan.usable(x, dt, A, B, C, D, z, h0)
    y, h = fused_scan.scan(x, dt, A, B, C, D, z, h0)
    want_y, want_h = reference(x, dt, A, B, C, D, z, h0)
    assert ((y.double() - want_y).abs().max() / want_y.abs().max()).item() <= 2e-6
    assert ((h.double() - want_h).abs().max() / want_h.abs().max()).item() <= 2e-6
    for a, b in zip(before, [t for t in (x, dt, A, B, C, D, z, h0) if t is not None]):
        assert torch.equal(a, b)


def _counting(monkeypatch):
    """The scan kernel's calls."""
    return count_calls(monkeypatch, fused_scan.KERNEL)


def test_selective_scan_takes_it_for_a_float32_prefill_and_packed_prompts(monkeypatch):
    calls = _counting(monkeypatch)
    x, dt, A, B, C, D, z, h0 = inputs(2, 23, 40, 8)
    y, h = selective_scan(x, dt, A, B, C, D=D, z=z, initial_state=h0, output_final_state=True)
    assert len(calls) == 1
    want_y, want_h = reference(x, dt, A, B, C, D, z, h0)
    assert ((y.double() - want_y).abs().max() / want_y.abs().max()).item() <= 2e-6
    # two prompts of 9 and 14 tokens packed in one row: each its own scan from its own state
    cu = torch.tensor([0, 9, 23])
    px, pdt, pB, pC, pz = (t[:1] for t in (x, dt, B, C, z))
    y, h = selective_scan(px, pdt, A, pB, pC, D=D, z=pz, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    for i, (a, b) in enumerate(((0, 9), (9, 23))):
        wy, wh = reference(*(t[:, a:b] for t in (px, pdt)), A, pB[:, a:b], pC[:, a:b], D, pz[:, a:b], h0[i:i + 1])
        assert ((y[:, a:b].double() - wy).abs().max() / wy.abs().max()).item() <= 2e-6
        assert ((h[i:i + 1].double() - wh).abs().max() / wh.abs().max()).item() <= 2e-6


def test_gradients_float64_compiling_and_kernels_off_keep_the_chunked_form(monkeypatch):
    calls = _counting(monkeypatch)
    x, dt, A, B, C, D, z, _ = inputs(1, 20, 16, 4)
    selective_scan(x.requires_grad_(), dt, A, B, C, D=D, z=z)[0].sum().backward()
    assert x.grad is not None
    selective_scan(*(t.double() for t in (x.detach(), dt, A, B, C)))
    assert not fused_scan.usable(x.detach().bfloat16(), dt, A, B, C)
    assert not fused_scan.usable(x.detach().transpose(1, 2).contiguous().transpose(1, 2), dt, A, B, C)
    monkeypatch.setenv("SUBQUAD_KERNELS", "0")
    selective_scan(x.detach(), dt, A, B, C)
    assert calls == []
    monkeypatch.delenv("SUBQUAD_KERNELS")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused_scan.usable(x.detach(), dt, A, B, C)


def test_a_mamba_models_prefill_equals_its_own_decoding(monkeypatch):
    """Prefill (the kernel) against the same prompt fed one token at a time from the state (the decoding step):
    the last logits and the states equal, for a batch of prompts of one length and for a packed ragged batch."""
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="mamba", mlp=False)).eval()
    ids = torch.randint(0, 64, (3, 19))
    with torch.no_grad():
        logits, state = model.prefill(ids, logits="last")
        assert len(calls) == 2                                           # one call per layer
        s = None
        for t in range(ids.shape[1]):
            step, s = model.step(ids[:, t:t + 1], s)
    assert ((logits.squeeze(1) - step).abs().max() / step.abs().max()).item() <= 1e-5
    for a, b in zip(state, s):
        assert ((a["ssm"] - b["ssm"]).abs().max() / b["ssm"].abs().max()).item() <= 1e-5


def test_a_verification_keeps_every_tokens_state_in_one_call(monkeypatch):
    """Under ``layers.rollback.PER_TOKEN`` (a speculative verification) the scan returns the state after each
    token, (Bz, T, D, N), from one kernel call; each equals the float64 scan stopped at that token."""
    from subquad.layers.rollback import PER_TOKEN

    calls = _counting(monkeypatch)
    x, dt, A, B, C, D, z, h0 = inputs(2, 9, 40, 8, strong=True)
    y, states = PER_TOKEN.recurrence(selective_scan, x, dt, A, B, C, D=D, z=z, mode="chunk", initial_state=h0)
    assert len(calls) == 1 and states.shape == (2, 9, 40, 8)
    want_y, _ = reference(x, dt, A, B, C, D, z, h0)
    assert ((y.double() - want_y).abs().max() / want_y.abs().max()).item() <= 2e-6
    for t in (0, 4, 8):
        _, want_h = reference(x[:, :t + 1], dt[:, :t + 1], A, B[:, :t + 1], C[:, :t + 1], h=h0)
        assert ((states[:, t].double() - want_h).abs().max() / want_h.abs().max()).item() <= 2e-6


@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_takes_dts_softplus_and_bias_as_it_reads_them(bias):
    """dt_t = softplus(dt_t + bias) computed in the loop (mamba_ssm's delta_softplus): raw dt of both signs and
    past softplus's threshold of 20, against the float64 scan of the step sizes made first."""
    x, _, A, B, C, D, z, h0 = inputs(2, 41, 70, 16, strong=True, seed=3)
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(2, 41, 70, generator=g) * 3
    raw[0, 5, :7] = 25.0                                               # above the threshold: dt = raw + bias
    b = torch.randn(70, generator=g) if bias else None
    y, h = fused_scan.scan(x, raw, A, B, C, D, z, h0, dt_bias=b, softplus=True)
    dt = F.softplus((raw + (0 if b is None else b)).double())
    want_y, want_h = reference(x, dt, A, B, C, D, z, h0)
    assert ((y.double() - want_y).abs().max() / want_y.abs().max()).item() <= 2e-6
    assert ((h.double() - want_h).abs().max() / want_h.abs().max()).item() <= 2e-6
    raw[1, 7, 8:24] = float("nan")                                     # whole vectors of NaN dt: NaN, as the
    y, h = fused_scan.scan(x, raw, A, B, C, D, z, h0, dt_bias=b, softplus=True)      # reference gives
    assert y[1, 7, 8:24].isnan().all() and h[1, 8:24].isnan().all() and not y[0].isnan().any()


def test_packed_prompts_go_to_the_kernel_in_one_call_read_in_place(monkeypatch):
    """``selective_scan(..., cu_seqlens=)`` where the kernel runs: one call for every prompt (no copies into a
    batch), each prompt from its own state row, with delta_bias and delta_softplus; lengths 1, 17 and 30."""
    calls = _counting(monkeypatch)
    x, _, A, B, C, D, z, _ = inputs(1, 48, 40, 8, seed=5)
    g = torch.Generator().manual_seed(6)
    raw, bias = torch.randn(1, 48, 40, generator=g), torch.randn(40, generator=g)
    h0 = torch.randn(3, 40, 8, generator=g)
    cu = torch.tensor([0, 1, 18, 48], dtype=torch.int32)
    before = [t.clone() for t in (x, raw, A, B, C, D, z, h0, bias)]
    y, h = selective_scan(x, raw, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True, initial_state=h0,
                          cu_seqlens=cu, output_final_state=True)
    assert len(calls) == 1 and y.shape == (1, 48, 40) and h.shape == (3, 40, 8)
    dt = F.softplus((raw + bias).double())
    for i, (a, b) in enumerate(((0, 1), (1, 18), (18, 48))):
        wy, wh = reference(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, z[:, a:b], h0[i:i + 1])
        assert ((y[:, a:b].double() - wy).abs().max() / wy.abs().max()).item() <= 2e-6
        assert ((h[i:i + 1].double() - wh).abs().max() / wh.abs().max()).item() <= 2e-6
    for a, b in zip(before, (x, raw, A, B, C, D, z, h0, bias)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="initial_state"):                # one state row per prompt, checked
        selective_scan(x, raw, A, B, C, delta_softplus=True, initial_state=h0[:2], cu_seqlens=cu)
