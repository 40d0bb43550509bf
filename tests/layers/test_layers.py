"""Every mixer layer: prefill then token-by-token decoding equals one forward; state bytes; bad input."""

import pytest
import torch

from subquad.layers import GatedLinearAttention, Mamba2, MultiScaleRetention, SoftmaxAttention, build_mixer
from tests.ops.harness import assert_close

D = 32
LAYERS = {
    "retention": lambda mode="chunk": MultiScaleRetention(D, n_heads=4, mode=mode, chunk_size=8),
    "gla": lambda mode="chunk": GatedLinearAttention(D, n_heads=2, mode=mode, chunk_size=8),
    "mamba2": lambda mode="chunk": Mamba2(D, d_state=8, head_dim=16, mode=mode, chunk_size=8),
    "deltanet": lambda mode="chunk": build_mixer("deltanet", D, 4, mode=mode, chunk_size=8),
    "gated_deltanet": lambda mode="chunk": build_mixer("gated_deltanet", D, 4, mode=mode, chunk_size=8),
    "mamba": lambda mode="chunk": build_mixer("mamba", D, 4, d_state=4, mode=mode, chunk_size=8),
    "softmax-gqa": lambda mode="chunk": build_mixer("softmax", D, 4, n_kv_heads=2, mode=mode, chunk_size=8),
    "swa": lambda mode="chunk": build_mixer("swa", D, 4, window=5, mode=mode, chunk_size=8),
    "linear": lambda mode="chunk": build_mixer("linear", D, 4, mode=mode, chunk_size=8),
    "performer": lambda mode="chunk": build_mixer("performer", D, 2, mode=mode, chunk_size=8),
    "taylor": lambda mode="chunk": build_mixer("taylor", D, 2, qk_dim=4, mode=mode, chunk_size=8),
    # the optional short convolution on q, k, v (conv_size; Zoology's protocol for the recall sweep)
    "linear-conv": lambda mode="chunk": build_mixer("linear", D, 4, conv_size=4, mode=mode, chunk_size=8),
    "retention-conv": lambda mode="chunk": MultiScaleRetention(D, n_heads=4, conv_size=3, mode=mode, chunk_size=8),
    "gla-conv": lambda mode="chunk": GatedLinearAttention(D, n_heads=2, conv_size=4, mode=mode, chunk_size=8),
    # checkpoints' variants: Zamba's multi-head Mamba, LFM3's gate per attention head, Ling's KDA gates
    "mamba-heads": lambda mode="chunk": build_mixer("mamba", D, 4, d_state=4, heads=2, mode=mode, chunk_size=8),
    "softmax-head-gate": lambda mode="chunk": build_mixer("swa", D, 4, window=5, head_gate=True, mode=mode,
                                                          chunk_size=8),
    "kda-ling": lambda mode="chunk": build_mixer("kda", D, 2, head_dim=8, full_gates=True, gate_bound=-5.0,
                                                 mode=mode, chunk_size=8),
}


def build(name, mode="chunk", seed=0):
    torch.manual_seed(seed)
    return LAYERS[name](mode).double().eval()


def inputs(B=2, T=23, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", LAYERS)
def test_prefill_then_step_decoding_equals_full_forward(name):
    layer, x = build(name), inputs()
    y_full, _ = layer(x)
    y_pre, state = layer(x[:, :9])
    ys = [y_pre]
    for t in range(9, x.shape[1]):
        y_t, state = layer(x[:, t:t + 1], state)
        ys.append(y_t)
    assert_close(torch.cat(ys, 1), y_full, 1e-10, f"{name} decode")


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("piece", [None, 16])
def test_no_grad_forward_equals_the_autograd_forward(name, piece):
    # Without a gradient the chunk forms take their fast paths (and Mamba-2 its shared-B/C SSD), and
    # fixed-state mixers run long inputs in pieces (here of 16 tokens); the output and the state they hand
    # on (checked through the next token) equal the autograd route's.
    layer, x = build(name), inputs(T=41)
    if piece and layer.piece_size:
        layer.piece_size = piece
    y, s = layer(x[:, :40])
    with torch.no_grad():
        y0, s0 = layer(x[:, :40])
        assert_close(y0, y, 1e-10, f"{name} no_grad output")
        assert_close(layer(x[:, 40:], s0)[0], layer(x[:, 40:], s)[0], 1e-10, f"{name} no_grad state")


@pytest.mark.parametrize("name", [n for n in LAYERS if build(n).piece_size])
def test_pieces_give_the_same_output_state_and_gradients(name):
    # A forward longer than piece_size runs piece by piece with the state carried, autograd included.
    x = inputs(T=41).requires_grad_()
    runs = []
    for piece in (None, 16):
        layer = build(name)
        layer.piece_size = piece
        y, s = layer(x)
        y_next, _ = layer(inputs(T=3, seed=2), s)
        loss = (y * torch.cos(y)).sum() + y_next.square().sum()
        runs.append([y, y_next] + list(torch.autograd.grad(loss, [x] + list(layer.parameters()))))
    for a, b in zip(*runs, strict=True):
        assert_close(b, a, 1e-10, name)


@pytest.mark.parametrize("name", LAYERS)
def test_forms_agree_inside_the_layer(name):
    x = inputs(T=19)
    y = {m: build(name, m)(x)[0] for m in ("parallel", "recurrent", "chunk")}
    assert_close(y["chunk"], y["parallel"], 1e-10, f"{name} chunk vs parallel")
    assert_close(y["recurrent"], y["parallel"], 1e-10, f"{name} recurrent vs parallel")


@pytest.mark.parametrize("name", LAYERS)
def test_empty_state_is_the_same_as_none_and_bytes_are_measured(name):
    layer, x = build(name), inputs(B=3)
    state = layer.empty_state(3, dtype=torch.float64)
    y0, s0 = layer(x)
    y1, s1 = layer(x, state)
    assert_close(y1, y0, 1e-12, "empty state")
    n = layer.state_bytes(s1)
    assert n > 0
    y2, s2 = layer(inputs(B=3, T=200), layer.empty_state(3, dtype=torch.float64))   # only softmax's cache grows
    if name == "softmax-gqa":
        assert layer.state_bytes(s2) > n
    else:
        assert layer.state_bytes(s2) == n


def test_state_sizes_match_the_analytic_figure():
    ret = MultiScaleRetention(D, n_heads=4)
    _, s = ret(torch.randn(1, 10, D))
    assert ret.state_bytes(s) == 4 * 8 * 16 * 4 + 8      # S (H, K, V) float32 + position counter
    m2 = Mamba2(D, d_state=8, head_dim=16)
    _, s = m2(torch.randn(1, 10, D))
    # h (H, N, P) and the conv tail (W-1, d_inner + 2N), float32
    assert m2.state_bytes(s) == (m2.n_heads * 8 * 16 + 3 * (2 * D + 2 * 8)) * 4


def mamba2_token_by_token(layer, x):
    """Mamba-2 written out one token at a time from the layer's weights, using none of the package's
    convolution, norm or SSD code: x (B, T, D) -> y (B, T, D), the final SSM state (B, H, N, P) and the
    convolution's last W - 1 inputs (B, W - 1, conv_dim)."""
    silu, softplus = torch.nn.functional.silu, torch.nn.functional.softplus
    B, T, _ = x.shape
    H, P, N, G = layer.n_heads, layer.head_dim, layer.d_state, layer.n_groups
    d_inner, W = layer.d_inner, layer.conv.kernel_size
    w_conv = layer.conv.weight[:, 0, :].T                                # (W, conv_dim), oldest tap first
    A = -torch.exp(layer.A_log)                                          # (H,)
    group = torch.arange(H) // (H // G)                                  # the B/C group each head reads
    window = torch.zeros(B, W, layer.conv_dim, dtype=x.dtype)            # the conv's last W inputs
    h = torch.zeros(B, H, N, P, dtype=x.dtype)
    ys = []
    for t in range(T):
        z, xBC, dt = torch.split(x[:, t] @ layer.in_proj.weight.T, [d_inner, layer.conv_dim, H], dim=-1)
        window = torch.cat([window[:, 1:], xBC[:, None]], 1)
        xBC = silu((window * w_conv).sum(1) + layer.conv.bias)
        xs, Bt, Ct = torch.split(xBC, [d_inner, G * N, G * N], dim=-1)
        xs = xs.reshape(B, H, P)
        Bt, Ct = Bt.reshape(B, G, N)[:, group], Ct.reshape(B, G, N)[:, group]    # (B, H, N)
        dt = softplus(dt + layer.dt_bias)                                 # (B, H)
        h = torch.exp(dt * A)[..., None, None] * h + dt[..., None, None] * Bt[..., :, None] * xs[..., None, :]
        y = torch.einsum("bhn,bhnp->bhp", Ct, h) + layer.D[:, None] * xs  # (B, H, P)
        g = (y.reshape(B, d_inner) * silu(z)).reshape(B, G, d_inner // G)
        g = g / torch.sqrt(g.square().mean(-1, keepdim=True) + layer.norm.eps)     # rmsnorm per group
        ys.append((g.reshape(B, d_inner) * layer.norm.weight) @ layer.out_proj.weight.T)
    return torch.stack(ys, 1), h, window[:, 1:]


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_equals_a_token_by_token_loop(n_groups):
    """The layer (chunked SSD with T not a multiple of C, with and without autograd) equals the block's
    equations run token by token: output, SSM state and convolution state."""
    torch.manual_seed(0)
    layer = Mamba2(D, d_state=8, head_dim=16, n_groups=n_groups, chunk_size=8).double()
    with torch.no_grad():                                 # weights away from their init: D = 1, norm weight 1
        for p in (layer.D, layer.norm.weight, layer.conv.bias):
            p.uniform_(-1.5, 1.5)
    x = inputs(B=3, T=37)
    with torch.no_grad():
        y_ref, h_ref, conv_ref = mamba2_token_by_token(layer, x)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            y, s = layer(x)
        assert_close(y, y_ref, 1e-10, f"mamba2 output vs loop (grad={grad})")
        assert_close(s["ssm"], h_ref, 1e-10, f"mamba2 SSM state vs loop (grad={grad})")
        assert_close(s["conv"], conv_ref, 1e-12, f"mamba2 conv state vs loop (grad={grad})")


@pytest.mark.parametrize("name", LAYERS)
def test_bad_input_raises(name):
    layer = build(name)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(2, 5, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(5, D, dtype=torch.float64))


def test_a_state_of_another_layer_batch_or_width_is_refused_by_name():
    """A state whose keys, rows or widths are not the layer's own (its empty_state's layout): a ValueError naming
    the key and the shapes, where a KeyError or a size error deep in the op came before; no tokens, likewise;
    a packed batch's state has a row per sequence. A good state still runs."""
    from subquad.layers import GatedDeltaNet

    torch.manual_seed(0)
    m, x = Mamba2(32), torch.randn(2, 5, 32)
    cases = [(GatedDeltaNet(32, n_heads=2).empty_state(2),
              r"takes a state with keys \['conv', 'ssm'\].*got \['S', 'conv'\]"),
             (m.empty_state(3), r"state\['(ssm|conv)'\]: Mamba2 takes \(2, .*for 2 row\(s\), got \(3, "),
             (Mamba2(64).empty_state(2), r"state\['(ssm|conv)'\]: Mamba2 takes \(2, "),
             (torch.zeros(1), r"keys \['conv', 'ssm'\].*got Tensor")]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            m(x, state)
    with pytest.raises(ValueError, match=r"at least one token, got shape \(2, 0, 32\)"):
        m(x[:, :0])
    with pytest.raises(ValueError, match=r"for 2 row\(s\), got \(1, "):
        m(x.reshape(1, 10, 32), m.empty_state(1), cu_seqlens=torch.tensor([0, 4, 10]))
    y, _ = m(x, m.empty_state(2))
    assert y.shape == x.shape


def test_grouped_query_attention_shrinks_the_cache():
    full = build_mixer("softmax", D, 4)
    gqa = build_mixer("softmax", D, 4, n_kv_heads=1)
    x = torch.randn(1, 50, D)
    assert gqa.state_bytes(gqa(x)[1]) * 4 == full.state_bytes(full(x)[1]) == 2 * 50 * D * 4


def test_unknown_mixer_is_refused():
    with pytest.raises(ValueError, match="unknown mixer 'mamba9'"):
        build_mixer("mamba9", D, 4)


def test_every_layer_class_documents_its_recurrence_arguments_and_state():
    from subquad.layers.registry import MIXERS

    for cls in {e.cls for e in MIXERS.values()}:
        doc = cls.__doc__ or ""
        assert "Args" in doc and "State" in doc and ("_t" in doc or "S_t" in doc), cls.__name__


def test_partial_rotary_rotates_the_leading_dims_only():
    """rotary_fraction: the first fraction of each head's dims rotate (with the base over those dims), the
    rest pass through (one rotated pair checked by hand)."""
    import math

    from subquad.layers.rotary import apply_rotary

    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, 12, dtype=torch.float64)
    y = apply_rotary(x, 3, base=500.0, dim=8)
    torch.testing.assert_close(y[..., 8:], x[..., 8:], rtol=0, atol=0)
    t, i = 2, 1                                          # position 3 + 2, pair (1, 5) of the 8 rotating dims
    ang = 5 * 500.0 ** (-2 * i / 8)
    want = x[0, t, 0, i] * math.cos(ang) - x[0, t, 0, i + 4] * math.sin(ang)
    assert abs(y[0, t, 0, i].item() - want.item()) < 1e-12
    layer = SoftmaxAttention(48, 4, rotary_fraction=0.5, rotary_base=500.0)
    assert layer.rotary_dim == 6
    with pytest.raises(ValueError, match="rotary_fraction"):
        SoftmaxAttention(48, 4, rotary_fraction=0.25)    # 3 of 12 dims: not even


def test_checkpoint_variant_options_refuse_bad_values():
    for name, bad, match in (("mamba", {"heads": 3}, "heads must be a positive int dividing d_inner=64"),
                             ("softmax", {"head_gate": 1}, "head_gate must be a bool"),
                             ("kda", {"gate_bound": 2.0}, "gate_bound must be None or a negative number"),
                             ("kda", {"full_gates": "yes"}, "full_gates must be a bool")):
        with pytest.raises(ValueError, match=match):
            build_mixer(name, D, 4, **bad)
