"""The residual schemes of ``models.lm``: the config picks the block class, every class holds the same
parameter names (the names the checkpoint formats map), and each computes its scheme."""

from __future__ import annotations

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.lm import ParallelBlock, PostNormBlock, PreNormBlock, SandwichNormBlock, ScaledResidualBlock


def _model(**over):
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "pattern": "softmax,mamba2",
                         "mixer_options": {"mamba2": {"head_dim": 8, "d_state": 4}}, **over})
    return LanguageModel(cfg).double()


def test_the_config_picks_the_block_class_and_the_names_stay():
    pre, post = _model(), _model(post_norm=["softmax"])
    scaled = _model(scaled_residual={"softmax": [1.5, 0.5], "mlp": [1.0, 2.0]})
    assert [type(b) for b in pre.blocks] == [PreNormBlock, PreNormBlock]
    assert [type(b) for b in post.blocks] == [PostNormBlock, PreNormBlock]
    assert [type(b) for b in scaled.blocks] == [ScaledResidualBlock, ScaledResidualBlock]
    assert scaled.blocks[0].mixer_factors == (1.5, 0.5) and scaled.blocks[1].mixer_factors == (1.0, 1.0)
    assert scaled.blocks[1].mlp_factors == (1.0, 2.0)
    keys = list(pre.state_dict())
    assert list(post.state_dict()) == keys and list(scaled.state_dict()) == keys


@pytest.mark.parametrize("scheme", ["pre", "post", "scaled", "parallel", "sandwich"])
def test_each_block_computes_its_scheme(scheme):
    over = {"pre": {}, "post": {"post_norm": ["softmax"]},
            "scaled": {"scaled_residual": {"softmax": [1.5, 0.5], "mlp": [0.75, 2.0]}},
            "parallel": {"parallel": {"softmax": "mamba2"}}, "sandwich": {"sandwich_norm": True}}[scheme]
    b = _model(**over).blocks[0]
    if scheme == "sandwich":
        assert isinstance(b, SandwichNormBlock)
        with torch.no_grad():                              # post-norms unlike the pre-norms
            b.post_norm1.weight.uniform_(0.5, 1.5)
            b.post_norm2.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 7, 16, dtype=torch.float64)
    got, _ = b(h)
    with torch.no_grad():
        if scheme == "pre":
            h1 = h + b.mixer(b.norm1(h))[0]
            want = h1 + b.mlp(b.norm2(h1))
        elif scheme == "parallel":
            x = b.norm1(h)
            h1 = h + b.mixer(x)[0] + b.beside(x)[0]
            want = h1 + b.mlp(b.norm2(h1))
        elif scheme == "post":
            h1 = h + b.norm1(b.mixer(h)[0])
            want = h1 + b.norm2(b.mlp(h1))
        elif scheme == "sandwich":
            h1 = h + b.post_norm1(b.mixer(b.norm1(h))[0])
            want = h1 + b.post_norm2(b.mlp(b.norm2(h1)))
        else:
            x = b.norm1(h)
            h1 = 1.5 * x + 0.5 * b.mixer(x)[0]
            x = b.norm2(h1)
            want = 0.75 * x + 2.0 * b.mlp(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_parallel_block_decodes_packs_and_refuses_what_it_cannot_hold():
    """Mamba-2 beside attention (Falcon-H1's block): one state dict holding both mixers' entries; prefill then
    token-by-token decoding, and a packed row, equal the full forward."""
    from tests.models.hf_harness import assert_packed_equals_separate, assert_prefill_then_decode_equals_forward

    model = _model(pattern="mamba2", parallel={"mamba2": "softmax"}).eval()
    assert [type(b) for b in model.blocks] == [ParallelBlock, ParallelBlock]
    assert set(model.empty_state(2)[0]) == {"ssm", "conv", "kv"}
    ids = torch.randint(0, 32, (2, 25), generator=torch.Generator().manual_seed(3))
    assert_prefill_then_decode_equals_forward(model, ids[:1, :20])
    assert_packed_equals_separate(model, ids)
    n = sum(p.numel() for p in model.parameters())
    assert n > sum(p.numel() for p in _model(pattern="mamba2").parameters())      # the attention beside, its own
    for bad in ({"mamba2": "mamba2"}, {"mamba2": "nope"}, {"softmax": 1}):
        with pytest.raises(ValueError, match="parallel must be"):
            _model(parallel=bad)
    with pytest.raises(ValueError, match="parallel blocks are pre-norm"):
        _model(parallel={"softmax": "mamba2"}, post_norm=["softmax"])


def test_a_parallel_blocks_decoding_step_takes_both_mixers_one_calls(monkeypatch):
    """Falcon-H1's block at a decoding step: Mamba-2's and attention's one calls (a pre-norm block's), each from
    the same norm of h, their outputs summed - within 1e-5 of the logits' scale of the PyTorch step's and of a
    float64 model's (not bit for bit: h + y0 + y1 summed as (h + y0) + ((h + y1) - h)), taken at every layer and
    step; a hook on a mixer turns it off."""
    from subquad.models import lm, stack
    from tests.ops.fused_harness import assert_steps_agree, models

    monkeypatch.setattr(stack, "ENABLED", False)
    m, m64 = models(d_model=64, n_layers=2, pattern="mamba2", parallel={"mamba2": "softmax"}, mlp=True,
                    mlp_size=96, n_heads=4, mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})
    assert_steps_agree(monkeypatch, lm.ParallelBlock, m, m64, 3, fn="_fused_mixers")
    taken, real = [], lm.ParallelBlock._fused_mixers

    def step():
        taken.clear()
        with torch.no_grad():
            _, st = m.prefill(torch.tensor([[1, 2, 3]]))
            m.step(torch.tensor([4]), st)
        return taken

    monkeypatch.setattr(lm.ParallelBlock, "_fused_mixers", lambda *a: taken.append(real(*a)) or taken[-1])
    assert [t is not None for t in step()] == [True, True]
    m.blocks[0].beside.register_forward_hook(lambda *a: None)
    assert [t is not None for t in step()] == [False, True]           # the hooked layer's modules, the other's calls


def test_a_shared_block_use_computes_its_scheme_and_bad_options_are_refused():
    """Zamba2's hybrid layer (models.shared): t = W proj(mlp(rmsnorm(attn(rmsnorm([h, e]))))) with the use's adapters
    added to q, k, v and to the MLP's gate and up; h + mixer(rmsnorm(h + t)). Written out here from the pieces."""
    import torch.nn.functional as F

    from subquad.layers.rotary import apply_rotary
    from subquad.models.lm import SharedUseBlock
    from subquad.models.shared import EMBEDDINGS

    model = _model(pattern="mamba2", mlp=False, shared={"layers": [0, 1], "adapter_rank": 3, "attention_adapter": True,
                                                        "hidden": 24, "act": "gelu", "scale": 0.5,
                                                        "rotary": True})
    b, u = model.blocks[1], model.blocks[1].use
    assert isinstance(b, SharedUseBlock) and u.shared is model.blocks[0].use.shared is model.shared[0]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    h, e = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    got, _ = b(h, carry={EMBEDDINGS: e})
    s = u.shared
    with torch.no_grad():
        x = s.norm1(torch.cat([h, e], -1))
        q, k, v = (p(x) + a(x) for p, a in ((s.attn.q_proj, u.q_adapter), (s.attn.k_proj, u.k_adapter),
                                            (s.attn.v_proj, u.v_adapter)))
        q, k = (apply_rotary(t.view(2, 7, 2, 16), 0, s.attn.rotary_base) for t in (q, k))   # 2 heads of 2 x 16 / 2
        q, k, v = (t.reshape(2, 7, 2, 16).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).transpose(1, 2).reshape(2, 7, 32)
        a = s.norm2(s.attn.o_proj(o))
        gate, up = (s.mlp.w_gate(a), s.mlp.w_up(a))
        dg, du = u.mlp_adapter(a).chunk(2, -1)
        t = u.proj(s.mlp.w_down(F.gelu(gate + dg) * (up + du)))
        want = h + b.mixer(b.norm1(h + t))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for bad, why in (({"layers": [2]}, "distinct layer indices"), ({"layers": [0], "act": "relu"}, "act"),
                     ({"layers": [0], "attention_adapter": True}, "adapter_rank >= 1"), ({"layers": [0], "x": 1}, "x"),
                     ({"layers": [0], "blocks": 0}, "blocks")):
        with pytest.raises(ValueError, match=why):
            _model(pattern="mamba2", shared=bad)
    with pytest.raises(ValueError, match="pre-norm"):
        _model(pattern="mamba2", shared={"layers": [0]}, parallel={"mamba2": "softmax"})


def test_sandwich_norms_refuse_the_other_schemes():
    for other in ({"post_norm": ["softmax"]}, {"parallel": {"softmax": "mamba2"}},
                  {"scaled_residual": {"softmax": [1.0, 1.0]}}):
        with pytest.raises(ValueError, match="sandwich_norm blocks take no"):
            _model(sandwich_norm=True, **other)
    with pytest.raises(ValueError, match="sandwich_norm must be a bool"):
        _model(sandwich_norm=1)


def test_hyper_connection_blocks_compute_their_scheme_and_the_model_mixes_the_streams():
    """``hyper`` (models.hyper): every block a HyperBlock over n streams - h + g_i branch(x), x and g from the
    branch's HyperConnection -, the embedding repeated into the streams and the final mix before the head."""
    from subquad.models.hyper import HyperConnection
    from subquad.models.lm import HyperBlock

    model = _model(hyper={"streams": 3, "rank": 4})
    b = model.blocks[0]
    assert all(isinstance(x, HyperBlock) for x in model.blocks) and isinstance(model.norm, HyperConnection)
    h = torch.randn(2, 7, 48, dtype=torch.float64)
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        got, _ = b(h)
        x, g = b.norm1(h)
        h1 = h + (g[..., None] * b.mixer(x)[0][..., None, :]).flatten(-2)
        x, g = b.norm2(h1)
        want = h1 + (g[..., None] * b.mlp(x)[..., None, :]).flatten(-2)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        h = model.embed(ids).repeat(1, 1, 3)
        for blk in model.blocks:
            h = blk(h)[0]
        torch.testing.assert_close(model(ids), model.norm(h) @ model.embed.weight.T, rtol=0, atol=1e-12)
    for other in ({"sandwich_norm": True}, {"post_norm": ["softmax"]}, {"parallel": {"softmax": "mamba2"}}):
        with pytest.raises(ValueError, match="hyper-connection blocks take no"):
            _model(hyper={"streams": 3, "rank": 4}, **other)
    with pytest.raises(ValueError, match=r"hyper\['streams'\] must be an int >= 2"):
        _model(hyper={"streams": 1, "rank": 4})
