"""Ops under torch.autocast, float32 accumulation for 16-bit inputs, value checks that can be switched off,
and sliding-window attention bounded in O(T W)."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from subquad.ops import (delta_rule, gated_delta_rule, gla, linear_attention, mlstm, retention, selective_scan,
                         set_checks, simple_gla, softmax_attention)
from subquad.ops.softmax.chunk import attention_forward
from subquad.ops.softmax.naive import naive_softmax_attention

B, T, H, K, V = 2, 45, 2, 8, 4
BF16_EPS = 2.0 ** -8       # bfloat16's relative rounding step


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g) for d in (K, K, V))
    return q, F.normalize(k, dim=-1), v, -torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)


CALLS = {
    "linear_attention": lambda q, k, v, g, b, m: linear_attention(q.abs(), k.abs(), v, mode=m)[0],
    "retention": lambda q, k, v, g, b, m: retention(q, k, v, torch.full((H,), -0.1), mode=m)[0],
    "simple_gla": lambda q, k, v, g, b, m: simple_gla(q, k, v, g, mode=m)[0],
    "gla": lambda q, k, v, g, b, m: gla(q, k, v, g.unsqueeze(-1).expand(-1, -1, -1, K).contiguous(), mode=m)[0],
    "delta_rule": lambda q, k, v, g, b, m: delta_rule(q, k, v, b, mode=m)[0],
    "gated_delta_rule": lambda q, k, v, g, b, m: gated_delta_rule(q, k, v, g, b, mode=m)[0],
    "softmax_attention": lambda q, k, v, g, b, m: softmax_attention(q, k, v, mode=m)[0],
    "mlstm": lambda q, k, v, g, b, m: mlstm(q, k, v, g, 4 * b - 2, mode=m)[0],     # b as the log input gate
}


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
@pytest.mark.parametrize("op", sorted(CALLS))
def test_ops_under_autocast_take_mixed_dtypes_and_return_autocast_dtype(op, mode):
    """Autocast hands an op 16-bit activations beside float32 gates; the op returns bfloat16 computed in
    float32 from the bfloat16 activations: within bfloat16 rounding of the float64 result on those inputs."""
    q, k, v, g, b = data()
    q16, k32, v16 = q.bfloat16(), k, v.bfloat16()             # mixed, as autocast produces them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = CALLS[op](q16, k32, v16, g, b, mode)
    assert out.dtype == torch.bfloat16
    ref = CALLS[op](q16.double(), k32.bfloat16().double(), v16.double(), g.double(), b.double(), mode)
    err = (out.double() - ref).abs()
    assert (err <= BF16_EPS * ref.abs() + 1e-4).all(), f"{op} {mode}: max error {err.max():.3g}"


def test_selective_scan_under_autocast():
    g = torch.Generator().manual_seed(1)
    x, Bm, Cm, z = (torch.randn(2, 33, n, generator=g) for n in (6, 4, 4, 6))
    dt, A = torch.rand(2, 33, 6, generator=g) * 0.1, -torch.rand(6, 4, generator=g) - 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, h = selective_scan(x.bfloat16(), dt, A, Bm.bfloat16(), Cm, z=z.bfloat16(), output_final_state=True)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    ref, _ = selective_scan(*(t.bfloat16().double() for t in (x,)), dt.double(), A.double(),
                            Bm.bfloat16().double(), Cm.bfloat16().double(), z=z.bfloat16().double())
    assert ((y.double() - ref).abs() <= BF16_EPS * ref.abs() + 1e-4).all()


def test_autocast_backward_inside_the_region_keeps_dtypes():
    """Backward called inside autocast: custom Functions switch autocast off there too."""
    q, k, v, g, b = data(2)
    for t in (q, k, v):
        t.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = delta_rule(q, k, v, b)
        o2, _ = linear_attention(q.abs(), k.abs(), v)
        (o.float().sum() + o2.float().sum()).backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("window", [None, 9])
def test_softmax_chunk_keeps_float32_state_for_bfloat16_inputs(window):
    """The running max, sum and accumulator are float32: lse and the unrounded output are within float32
    accumulation error of float64 on the same bfloat16 inputs; the returned output within bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 200, 2, 16, generator=g).mul(3).bfloat16() for _ in range(3))
    o, _, lse = softmax_attention(q, k, v, window=window, mode="chunk", chunk_size=16, return_lse=True)
    ref, _, ref_lse = naive_softmax_attention(q.double(), k.double(), v.double(), window=window, return_lse=True)
    assert lse.dtype == torch.float32 and o.dtype == torch.bfloat16
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)
    assert ((o.double() - ref).abs() <= BF16_EPS * ref.abs() + 1e-6).all()
    o32, lse32 = attention_forward(*(x.transpose(1, 2) for x in (q, k, v)), 16 ** -0.5, 16, True, window, 0, 0)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.transpose(1, 2).double(), ref, rtol=1e-5, atol=1e-5)


def test_value_checks_can_be_switched_off():
    q, k, v, g, b = data()
    with pytest.raises(ValueError, match="g is a log-decay"):
        simple_gla(q, k, v, g.abs())
    with pytest.raises(ValueError, match="beta"):
        delta_rule(q, k, v, b + 1.5)
    try:
        set_checks(False)                     # no value is read: no host sync on an accelerator
        simple_gla(q, k, v, -g)
        delta_rule(q, k, v, b)
    finally:
        set_checks(None)
    with pytest.raises(ValueError, match="enabled"):
        set_checks("yes")


def test_performer_without_normalisation_is_refused():
    from subquad.layers import LinearAttention

    with pytest.raises(ValueError, match="normalize=True"):
        LinearAttention(32, 2, feature_map="performer", normalize=False)


@pytest.mark.parametrize("mode", ["parallel", "chunk"])
def test_sliding_window_equals_naive_at_small_T(mode):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 301, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for W in (0, 17, 100):
        ref, _ = naive_softmax_attention(q, k, v, window=W)
        got, _ = softmax_attention(q, k, v, window=W, mode=mode, chunk_size=32)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["parallel", "chunk"])
def test_sliding_window_at_64k_tokens_stays_within_512_mib(mode):
    """T = 65,536, W = 512: a dense mask alone would be 4 GiB. Peak RSS growth of a fresh process over the
    call (inputs already allocated) must stay below 512 MiB."""
    code = textwrap.dedent(f"""
        import resource, torch
        from subquad.ops import softmax_attention
        torch.set_num_threads(2)
        q, k, v = (torch.randn(1, 65536, 2, 16) for _ in range(3))
        softmax_attention(q[:, :256], k[:, :256], v[:, :256], window=512, mode="{mode}")   # warm up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with torch.no_grad():
            o, _ = softmax_attention(q, k, v, window=512, mode="{mode}", chunk_size=128)
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(extra // 1024, bool(torch.isfinite(o).all()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    mib, finite = out.stdout.split()
    assert finite == "True" and int(mib) < 512, f"{mode}: {mib} MiB extra"
