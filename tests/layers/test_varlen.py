"""Packed sequences (cu_seqlens) through every layer and a hybrid model: equal to each sequence alone,
forward and backward; a ragged prefill then batched decoding equals each sequence decoded alone."""

from __future__ import annotations

import pytest
import torch

from subquad.layers import build_mixer
from subquad.layers.registry import causal_mixers
from subquad.models import LanguageModel, ModelConfig

F64 = torch.float64
D = 16
LENGTHS = [5, 1, 9, 3, 12]
NAMES = causal_mixers() + ["linear+conv", "retention+conv", "gla+conv"]   # + the short-conv option


def _layer(name):
    torch.manual_seed(0)
    opts = {"chunk_size": 4}
    if name == "swa":
        opts["window"] = 3
    if name.endswith("+conv"):
        name, opts["conv_size"] = name[:-5], 4
    return build_mixer(name, D, 2, **opts).double()


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_state", [False, True])
def test_layer_packed_equals_separate_forward_and_backward(name, with_state):
    layer = _layer(name)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, L, D, generator=g, dtype=F64) for L in LENGTHS]
    x = torch.cat(xs, 1).requires_grad_(True)
    states = None
    if with_state:                                       # continue each sequence after a prompt of its own
        prompts = [torch.randn(1, 2 + i, D, generator=g, dtype=F64) for i in range(len(LENGTHS))]
        states = [layer(p)[1] for p in prompts]
        _, packed_state = layer(torch.cat(prompts, 1), cu_seqlens=_cu([p.shape[1] for p in prompts]))
    y, _ = layer(x, packed_state if with_state else None, cu_seqlens=_cu(LENGTHS))
    w = torch.randn(y.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((y * w).sum(), [x] + list(layer.parameters()), allow_unused=True)
    ys, s = [], 0
    for i, L in enumerate(LENGTHS):
        yi, _ = layer(x[:, s:s + L], None if states is None else states[i])
        ys.append(yi)
        s += L
    ref = torch.cat(ys, 1)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-10)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x] + list(layer.parameters()), allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_linformer_refuses_packed_sequences():
    from subquad.layers import Linformer

    layer = Linformer(D, 2, max_len=32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(1, 8, D), cu_seqlens=torch.tensor([0, 3, 8]))


def test_layer_rejects_cu_seqlens_that_do_not_cover_x():
    layer = _layer("gla")
    with pytest.raises(ValueError, match="packed as"):
        layer(torch.randn(1, 8, D, dtype=F64), cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="batch must be 1|packed as"):
        layer(torch.randn(2, 8, D, dtype=F64), cu_seqlens=torch.tensor([0, 3, 8]))



def test_a_model_names_a_cu_seqlens_that_is_not_one_dimensional():
    model = _model()
    idx = torch.randint(0, 40, (1, 8))
    for bad in (torch.tensor([[0, 3, 8]]), torch.tensor([[0, 3], [3, 8]])):     # not torch's "one element" message
        with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D integer tensor .*(\[1, 3\]|\[2, 2\])"):
            model(idx, cu_seqlens=bad)


def _model(pos_emb="none", n_kv_heads=None):
    torch.manual_seed(0)
    pattern = "softmax,swa,linear,retention,gla,deltanet,gated_deltanet,mamba,mamba2,kda,mla,lightning"
    cfg = ModelConfig(vocab_size=40, d_model=D, n_layers=12, n_heads=2, n_kv_heads=n_kv_heads, pattern=pattern,
                      context_length=64, pos_emb=pos_emb, mixer_options={"swa": {"window": 3}, "*": {"chunk_size": 4}})
    return LanguageModel(cfg).double()


@pytest.mark.parametrize("pos_emb,n_kv_heads", [("none", None), ("learned", 1)])
def test_model_packed_forward_backward_then_batched_decoding(pos_emb, n_kv_heads):
    model = _model(pos_emb, n_kv_heads)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 40, (1, L), generator=g) for L in LENGTHS]
    logits, state = model.prefill(torch.cat(seqs, 1), cu_seqlens=_cu(LENGTHS))
    w = torch.randn(logits.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((logits * w).sum(), list(model.parameters()), allow_unused=True)
    alone = [model.prefill(s) for s in seqs]
    ref = torch.cat([a[0] for a in alone], 1)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)
    ref_grads = torch.autograd.grad((ref * w).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert state.pos.tolist() == LENGTHS
    # five batched decoding steps from the ragged state equal each sequence decoded alone
    steps = torch.randint(0, 40, (len(LENGTHS), 5), generator=g)
    with torch.no_grad():
        batched = []
        for t in range(5):
            out, state = model.prefill(steps[:, t:t + 1], state)
            batched.append(out)
        batched = torch.cat(batched, 1)
        for i, (_, s) in enumerate(alone):
            own = []
            for t in range(5):
                out, s = model.prefill(steps[i:i + 1, t:t + 1], s)
                own.append(out)
            torch.testing.assert_close(batched[i:i + 1], torch.cat(own, 1), rtol=0, atol=1e-10)


def test_no_token_reaches_another_document():
    """The gradient of document 1's logits with respect to document 0's embeddings is exactly zero."""
    model = _model("learned")
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 40, (1, 20), generator=g)
    cu = torch.tensor([0, 9, 20])
    h0 = model.embed(idx).detach().requires_grad_(True)
    hook = model.embed.register_forward_hook(lambda mod, inp, out: h0)
    try:
        logits, _ = model.prefill(idx, cu_seqlens=cu)
    finally:
        hook.remove()
    grad = torch.autograd.grad(logits[:, 9:].sum(), h0)[0]
    assert grad[:, :9].abs().max() == 0 and grad[:, 9:].abs().max() > 0


def test_generate_ragged_batch_equals_each_prompt_alone():
    model = _model()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [3, 3, 8]]
    outs, _ = model.generate(prompts, 6, temperature=0)
    for p, o in zip(prompts, outs):
        assert model.generate(p, 6, temperature=0)[0] == o


@pytest.mark.parametrize("name", [n for n in NAMES if _layer(n).piece_size])
def test_long_packed_rows_run_in_pieces_of_whole_sequences(name):
    """With piece_size 6 the packed row (5, 1, 9, 3, 12 tokens) runs as pieces of whole sequences (and the
    long ones in pieces of their own) without autograd: the same outputs and states as one call."""
    layer = _layer(name)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, sum(LENGTHS), D, generator=g, dtype=F64, requires_grad=True)
    prompts = torch.randn(1, sum(LENGTHS), D, generator=g, dtype=F64)
    _, state = layer(prompts, cu_seqlens=_cu(LENGTHS))
    default = layer.piece_size
    outs = []
    for piece in (default, 6):
        layer.piece_size = piece
        with torch.no_grad():                      # pieces are for inference; with autograd the row is whole
            outs.append(layer(x, state, cu_seqlens=_cu(LENGTHS)))
    layer.piece_size = default
    (y0, s0), (y1, s1) = outs
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-10)
    for key in s0:
        torch.testing.assert_close(s1[key], s0[key], rtol=0, atol=1e-10)


@pytest.mark.parametrize("make", [lambda: __import__("subquad.layers", fromlist=["Mamba2"]).Mamba2(
    D, d_state=4, head_dim=8, n_groups=2, chunk_size=4, norm_eps=1e-5),
    lambda: __import__("subquad.layers", fromlist=["Mamba"]).Mamba(D, d_state=4, bcdt_rms_eps=1e-6, chunk_size=4)],
    ids=["mamba2_groups", "falcon_mamba"])
def test_checkpoint_options_behave_like_every_mixer(make):
    """Mamba-2 with n_groups and Mamba with Falcon's norms (the options the checkpoint loaders use): packed
    equals separate, prefill then decoding equals one call, the state passed in is untouched, bf16 runs."""
    torch.manual_seed(0)
    layer = make().double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, sum(LENGTHS), D, generator=g, dtype=F64)
    y, _ = layer(x, cu_seqlens=_cu(LENGTHS))
    ys, s = [], 0
    for L in LENGTHS:
        ys.append(layer(x[:, s:s + L])[0])
        s += L
    torch.testing.assert_close(y, torch.cat(ys, 1), rtol=0, atol=1e-10)
    full, _ = layer(x)
    y1, st = layer(x[:, :10])
    snapshot = {k: v.clone() for k, v in st.items()}
    y2, _ = layer(x[:, 10:], st)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, rtol=0, atol=1e-10)
    assert all(torch.equal(st[k], snapshot[k]) for k in st)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb, _ = layer.float()(x.float())
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all()
