"""A decoding token's softmax attention half in two C calls (layers.attention_step, kernels/attention_step.c)
against the layer's own step (SDPA over the cache) and a float64 model: full, partial and no rotary, grouped
heads, a scale, an output bias, q / k norms per head and the output gate (Qwen3.5's), 1 to 16 rows, a ragged
(left-padded) batch, quantised projections; the cache passed in unchanged; what keeps the layer's own step."""

from __future__ import annotations

import pytest
import torch

from subquad.layers import attention_step
from subquad.layers.attention import SoftmaxAttention
from subquad.layers.norm import RMSNorm
from subquad.models import stack
from subquad.ops import KVCache
from tests.ops.fused_harness import assert_steps_agree, count_calls, models, step_logits

pytestmark = pytest.mark.skipif(not attention_step.OUT.available(), reason="no C compiler: the kernel cannot be built")


def counted(monkeypatch):
    return count_calls(monkeypatch, attention_step.Step)


@pytest.mark.parametrize("heads,options", [
    ((4, 2), {"rotary_fraction": 0.5}),                   # Bamba's: grouped heads, half the dims rotate
    ((4, 4), {"scale": 0.3, "o_bias": True}),             # full rotary, a scale, a bias
    ((6, 2), {"rotary": False, "head_dim": 12}),          # Jamba's: no positions
    ((4, 2), {"output_gate": True, "qk_norm": "head"}),   # Qwen3.5's: gated, q and k normed per head
])
def test_a_hybrids_attention_agrees_with_the_layer_and_float64(monkeypatch, heads, options):
    """3 rows, 4 tokens after a 9-token prompt: within 1e-5 of the logits' scale of the layer's own step and of a
    float64 model's; each token's attention layer takes the two calls."""
    monkeypatch.setattr(stack, "ENABLED", False)
    m, m64 = models(d_model=48, n_layers=3, pattern="mamba2,softmax,mamba2", mlp=True, mlp_size=64,
                    n_heads=heads[0], n_kv_heads=heads[1],
                    mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}, "softmax": options})
    calls = counted(monkeypatch)
    assert_steps_agree(monkeypatch, attention_step, m, m64, 4, fn="fused_attention")
    assert len(calls) == 4


def layer_and_cache(B, lengths, seed=0, **options):
    """A SoftmaxAttention (d_model 48, 4 heads over 2) with a norm, and a cache of ``lengths`` tokens per row
    (left-padded where they differ, as a served batch's)."""
    torch.manual_seed(seed)
    attn, norm = SoftmaxAttention(48, 4, 2, rotary_fraction=0.5, **options).eval(), RMSNorm(48)
    with torch.no_grad():
        for n in [norm] + ([attn.q_norm, attn.k_norm] if attn.qk_norm else []):
            n.weight.uniform_(0.5, 1.5)
    caches = [KVCache(torch.randn(1, n, 2, 12), torch.randn(1, n, 2, 12), seen=n + 3 * b)
              for b, n in enumerate(lengths)]
    cache = caches[0] if B == 1 else KVCache.stack(caches)
    return attn, norm, cache


def reference(attn, norm, h, cache):
    """The layer's own step: h + attend(project(norm(h))) through SDPA, in float64 from the same tensors."""
    import copy

    a64, n64 = copy.deepcopy(attn).double(), copy.deepcopy(norm).double()
    c64 = KVCache(cache.k.double(), cache.v.double(), seen=cache.seen, pad=cache.pad, row_seen=cache.row_seen)
    y, new = a64.mix(n64(h.double()), {"kv": c64}, attention_step.SingleDevice())
    return h.double() + y, new["kv"]


@pytest.mark.parametrize("B,lengths,options", [(1, [7], {}), (3, [5, 9, 2], {}), (16, list(range(1, 17)), {}),
                                               (3, [5, 9, 2], {"output_gate": True, "qk_norm": "head"})])
def test_one_token_against_the_layer_in_float64_ragged_rows_and_the_cache_untouched(B, lengths, options):
    attn, norm, cache = layer_and_cache(B, lengths, **options)
    h = torch.randn(B, 1, 48) * 2
    before = (cache.k.clone(), cache.v.clone(), len(cache), cache.seen)
    want, want_cache = reference(attn, norm, h, cache)
    with torch.no_grad():
        got, state = attention_step.fused_attention(attn, h, norm, {"kv": cache})
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    new = state["kv"]
    assert len(new) == len(cache) + 1 and new.seen == cache.seen + 1
    assert (new.k.double() - want_cache.k).abs().max() <= 1e-5 * want_cache.k.abs().max()   # rotated k appended
    assert torch.equal(new.v[:, -1:].double(), want_cache.v[:, -1:].float().double()) or \
        (new.v.double() - want_cache.v).abs().max() <= 1e-5 * want_cache.v.abs().max()
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1])        # the state passed in
    assert (len(cache), cache.seen) == before[2:]


def test_quantised_projections(monkeypatch):
    """int8 q, k, v and o (x rounded per block of 32 in the kernels): within 2% of the logits' scale of the
    layer's own step through the same modules."""
    from subquad.models.quant import quantize

    monkeypatch.setattr(stack, "ENABLED", False)
    m, _ = models(d_model=64, n_layers=2, pattern="softmax,mamba2", mlp=True, mlp_size=64, n_heads=4,
                  mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})
    quantize(m, "int8", min_weights=0)
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])

    a = step_logits(m, ids, tok)
    assert len(calls) == 1
    monkeypatch.setattr(attention_step, "fits", lambda attn, norm: False)
    b = step_logits(m, ids, tok)
    assert len(calls) == 1 and (a - b).abs().max() <= 2e-2 * b.abs().max()


@pytest.mark.parametrize("options", [{"qk_norm": "all"}, {"window": 4}, {"head_gate": True}])
def test_what_the_kernels_do_not_compute_keeps_the_layers_step(options):
    attn, norm, cache = layer_and_cache(1, [5], **options)
    if options.get("window"):
        cache = KVCache(cache.k, cache.v, window=4)
    with torch.no_grad():
        assert attention_step.fused_attention(attn, torch.randn(1, 1, 48), norm, {"kv": cache}) is None


def test_hooks_autocast_gradients_and_a_new_weight(monkeypatch):
    """A hook on the layer runs the layer (and the hook); bf16 autocast and gradients take the layer's step; a
    weight replaced between tokens is read at the next."""
    monkeypatch.setattr(stack, "ENABLED", False)
    m, _ = models(d_model=48, n_layers=2, pattern="softmax,mamba2", mlp=False, n_heads=4,
                  mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([3])

    def step(kernels=True):
        monkeypatch.setenv("SUBQUAD_KERNELS", "1" if kernels else "0")
        with torch.no_grad():
            _, st = m.prefill(ids)
            return m.step(tok, st)[0]
    first = step()
    assert len(calls) == 1
    seen = []
    handle = m.blocks[0].mixer.register_forward_hook(lambda *a: seen.append(1))
    step()
    assert len(calls) == 1 and len(seen) == 2                       # prefill and step
    handle.remove()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, st = m.prefill(ids)
        m.step(tok, st)
    _, st = m.prefill(ids)
    m.step(tok, st)
    assert len(calls) == 1
    attn = m.blocks[0].mixer
    attn.v_proj.weight.data = attn.v_proj.weight.data * 3
    changed = step()
    assert len(calls) == 2 and (changed - first).abs().max() > 1e-4
    assert (changed - step(False)).abs().max() <= 1e-5 * changed.abs().max()


def test_compiling_another_backend_or_packed_rows_keep_the_modules(monkeypatch):
    """While compiling (inductor fuses the block itself), under another sequence backend (a verification's
    ``PerToken``, a context-parallel one) or with packed rows (``cu_seqlens``), neither the attention call nor the
    MLP call runs: the layer's own ops do."""
    from subquad.layers import mlp_step, sequence
    from subquad.layers.mlp import SwiGLU
    from subquad.layers.rollback import PerToken

    attn, norm, cache = layer_and_cache(1, [5])
    mlp, h = SwiGLU(48, 64).eval(), torch.randn(1, 1, 48)
    with torch.no_grad():
        assert attention_step.fused_attention(attn, h, norm, {"kv": cache}) is not None    # the plain case runs
        assert mlp_step.fused_mlp(mlp, h, norm) is not None
        with sequence.use(PerToken()):
            assert attention_step.fused_attention(attn, h, norm, {"kv": cache}) is None
        with sequence.use(sequence.Packed(torch.tensor([0, 1]))):
            assert attention_step.fused_attention(attn, h, norm, {"kv": cache}) is None
        with monkeypatch.context() as p:
            p.setattr(torch.compiler, "is_compiling", lambda: True)
            assert attention_step.fused_attention(attn, h, norm, {"kv": cache}) is None
            assert mlp_step.fused_mlp(mlp, h, norm) is None
