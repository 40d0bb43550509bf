import pytest
import torch

from subquad.layers import Linformer
from subquad.ops import linformer_attention, naive_softmax_attention
from tests.ops.harness import assert_close


def qkv(T=24, H=2, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, T, H, K, generator=g, dtype=torch.float64) for _ in range(3)]


def test_with_k_equal_T_and_identity_projections_it_is_full_softmax_attention():
    q, k, v = qkv()
    eye = torch.eye(24, dtype=torch.float64)
    o, state = linformer_attention(q, k, v, eye, eye)
    ref, _ = naive_softmax_attention(q, k, v, causal=False)
    assert state is None
    assert_close(o, ref, 1e-12, "linformer(E=F=I) vs softmax")


def test_per_head_projections_and_shorter_inputs():
    q, k, v = qkv(T=10)
    E = torch.randn(2, 4, 16, dtype=torch.float64)
    o, _ = linformer_attention(q, k, v, E, E)
    assert o.shape == v.shape
    o0, _ = linformer_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], E[0], E[0])
    assert_close(o[:, :, :1], o0, 1e-12, "head 0")


def test_low_rank_projection_approximates_attention_better_as_k_grows():
    # a random projection to k rows: the error against full attention shrinks as k grows to T
    q, k, v = qkv(T=64, seed=3)
    ref, _ = naive_softmax_attention(q, k, v, causal=False)
    g = torch.Generator().manual_seed(0)
    errs = []
    for kk in (4, 64):
        P = torch.randn(kk, 64, generator=g, dtype=torch.float64) / kk ** 0.5 if kk < 64 else torch.eye(64, dtype=torch.float64)
        errs.append((linformer_attention(q, k, v, P, P)[0] - ref).abs().max().item())
    assert errs[1] < 1e-12 < errs[0]


def test_causal_decoding_and_long_inputs_are_refused():
    q, k, v = qkv(T=24)
    E = torch.randn(4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="no causal form"):
        linformer_attention(q, k, v, E, E, causal=True)
    with pytest.raises(ValueError, match="only the parallel form"):
        linformer_attention(q, k, v, E, E, mode="recurrent")
    with pytest.raises(ValueError, match="carries no state"):
        linformer_attention(q, k, v, E, E, output_final_state=True)
    with pytest.raises(ValueError, match="exceeds the length 16"):
        linformer_attention(q, k, v, E, E)
    layer = Linformer(32, 4, max_len=16, k=8)
    y, st = layer(torch.randn(2, 16, 32))
    assert y.shape == (2, 16, 32) and st is None
    with pytest.raises(ValueError, match="cannot decode"):
        layer(torch.randn(2, 4, 32), state={})
    with pytest.raises(ValueError, match="exceeds"):
        layer(torch.randn(2, 17, 32))


def test_the_layer_in_float64_is_its_formula():
    """The table's linformer (per-head projections too): o = softmax(q (E K)^T / sqrt(K)) (F V), written out."""
    for share_heads in (True, False):
        torch.manual_seed(0)
        layer = Linformer(16, 2, max_len=12, k=5, share_heads=share_heads).double()
        x = torch.randn(2, 9, 16, dtype=torch.float64)
        y, _ = layer(x)
        B, T, H, K = 2, 9, 2, 8
        q, k, v = (p(x).view(B, T, H, K).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        E, F = (P[..., :T].expand(H, 5, T) for P in (layer.E, layer.F))
        kp, vp = E @ k, F @ v                                          # (B, H, k, K)
        o = torch.softmax(q @ kp.transpose(-1, -2) / K ** 0.5, -1) @ vp
        ref = layer.o_proj(o.transpose(1, 2).reshape(B, T, H * K))
        assert_close(y, ref, 1e-12, f"linformer layer (share_heads={share_heads}) vs its formula")
