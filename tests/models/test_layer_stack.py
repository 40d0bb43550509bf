"""models.layer_stack: a decoding token's run of Mamba-2 and softmax attention blocks (a hybrid's; a transformer's)
in one C call, the attention layers' cache appends inside it - equal, bit for bit, to the blocks one by one (whose
own tests hold them to float64), and within 1e-5 of a float64 forward of the whole sequence; ragged (served)
batches, quantised weights, the state passed in untouched, and what keeps the blocks one by one."""

from __future__ import annotations

import pytest
import torch

from subquad.models import layer_stack, stack
from subquad.models.quant import quantize
from subquad.models.state import save_state
from tests.models.test_stack import assert_near_float64, assert_same, head_through_the_modules, steps  # noqa: F401
from tests.ops.fused_harness import count_calls, models

pytestmark = pytest.mark.skipif(not layer_stack.KERNEL.available(), reason="no C compiler: the kernel cannot be built")

MAMBA2 = {"d_state": 16, "head_dim": 16}


def hybrid(pattern="mamba2,mamba2,softmax,mamba2,softmax", mlp_kind="swiglu", heads=(4, 2), attention=None,
           mlp_size=64, d_model=48):
    return models(d_model=d_model, n_layers=len(pattern.split(",")), pattern=pattern, mlp=True, mlp_size=mlp_size,
                  n_heads=heads[0], n_kv_heads=heads[1], mlp_kind=mlp_kind,
                  mixer_options={"mamba2": MAMBA2, "softmax": attention or {"rotary_fraction": 0.5}})


def counted(monkeypatch):
    return count_calls(monkeypatch, layer_stack.MixedStep)


@pytest.mark.parametrize("B,mlp_kind,heads,attention", [
    (1, "swiglu", (4, 2), {"rotary_fraction": 0.5}),                 # Bamba's: grouped heads, half rotary
    (3, "swiglu", (4, 2), {"rotary_fraction": 0.5}),
    (3, "relu2", (4, 4), {"rotary": False, "o_bias": True}),          # Nemotron-H's: no positions, ReLU^2
    (2, "swiglu", (6, 2), {"scale": 0.3, "head_dim": 12}),
    (3, "swiglu", (4, 2), {"output_gate": True, "qk_norm": "head"}),  # Qwen3.5's: gated, q and k normed per head
])
def test_a_hybrids_layers_in_one_call_equal_them_one_by_one_and_float64(monkeypatch, B, mlp_kind, heads, attention):
    """5 layers (Mamba-2, Mamba-2, attention, Mamba-2, attention, each with an MLP) as one run; 12 tokens after a
    7-token prompt, so the caches grow past their first buffer (16) inside the run."""
    m, m64 = hybrid(mlp_kind=mlp_kind, heads=heads, attention=attention)
    assert stack.runs(m.blocks) == ((0, 5),)
    ids = torch.randint(0, 300, (B, 7), generator=torch.Generator().manual_seed(B))
    tok = torch.tensor([4, 100, 299][:B])
    calls = counted(monkeypatch)
    one = steps(m, ids, tok, 12, True, monkeypatch)
    assert len(calls) == 11                       # the first token builds the blocks' steps, then one call each
    assert_same(one, steps(m, ids, tok, 12, False, monkeypatch))
    assert_near_float64(m64, ids, tok, one)


def test_a_transformers_layers_in_one_call(monkeypatch):
    """Attention blocks alone (a Llama-shaped model: rotary, grouped heads, SwiGLU) form a run too."""
    m, m64 = hybrid(pattern="softmax,softmax,softmax", heads=(4, 2), attention={})
    assert stack.runs(m.blocks) == ((0, 3),)
    ids, tok = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(3)), torch.tensor([7, 8])
    calls = counted(monkeypatch)
    one = steps(m, ids, tok, 5, True, monkeypatch)
    assert len(calls) == 4
    assert_same(one, steps(m, ids, tok, 5, False, monkeypatch))
    assert_near_float64(m64, ids, tok, one)


def test_a_ragged_batch_as_a_server_holds_it(monkeypatch):
    """Three prompts of 5, 9 and 2 tokens prefilled packed (each row's cache left-padded, its own positions), then
    decoded together: equal to the blocks one by one, and each row within 1e-5 of its own sequence in float64."""
    m, m64 = hybrid()
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 2)]
    packed, cu = torch.cat(prompts)[None], torch.tensor([0, 5, 14, 16])
    calls = counted(monkeypatch)

    def run(enabled):
        monkeypatch.setattr(stack, "ENABLED", enabled)
        out, tok = [], torch.tensor([3, 30, 300 - 1])
        with torch.no_grad():
            _, st = m.prefill(packed, cu_seqlens=cu)
            assert st[2]["kv"].ragged
            for _ in range(4):
                logits, st = m.step(tok, st)
                out.append((logits, st))
                tok = logits.argmax(-1)
        return out

    one = run(True)
    assert len(calls) == 3
    assert_same(one, run(False))
    for b, p in enumerate(prompts):
        toks = [torch.tensor([3, 30, 299])[b]] + [lg[b].argmax(-1) for lg, _ in one[:-1]]
        with torch.no_grad():
            full = m64(torch.cat([p, torch.stack(toks)])[None])[0, len(p):]
        for i, (logits, _) in enumerate(one):
            assert (logits[b].double() - full[i]).abs().max() <= 1e-5 * full.abs().max()


def test_the_state_passed_in_is_untouched_and_the_new_one_saves(monkeypatch):
    """Two steps from one state give the same logits and states (the second fork moves to fresh buffers: the
    first wrote past the shared entries); the caches and Mamba-2 states passed in keep their entries; the new
    state's tensors are their own (a state saves)."""
    m, _ = hybrid()
    calls = counted(monkeypatch)
    tok = torch.tensor([5, 6])
    with torch.no_grad():
        _, st = m.prefill(torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0)))
        _, st = m.step(tok, st)
        before = [{k: (v.k.clone(), v.v.clone(), len(v), v.seen) if k == "kv" else v.clone() for k, v in s.items()}
                  for s in st]
        a, new_a = m.step(tok, st)
        b, new_b = m.step(tok, st)
    assert len(calls) == 2
    assert_same([(a, new_a)], [(b, new_b)])
    for s, kept in zip(st, before):
        for k, v in s.items():
            if k == "kv":
                assert torch.equal(v.k, kept[k][0]) and torch.equal(v.v, kept[k][1]) \
                    and (len(v), v.seen) == kept[k][2:]
            else:
                assert torch.equal(v, kept[k])
    assert len(new_a[2]["kv"]) == len(st[2]["kv"]) + 1
    save_state("/dev/null", new_a)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantised_weights(monkeypatch, kind):
    m, _ = hybrid(mlp_size=128, d_model=64)
    quantize(m, kind, group_size=32) if kind == "int4" else quantize(m, kind)
    ids, tok = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])
    calls = counted(monkeypatch)
    assert_same(steps(m, ids, tok, 4, True, monkeypatch), steps(m, ids, tok, 4, False, monkeypatch))
    assert len(calls) == 3


def test_what_keeps_the_blocks_one_by_one(monkeypatch):
    """A hook on an attention block runs (its run goes one by one while it is there); a window set between tokens
    is seen; a windowed attention layer splits the runs (the kernel reads no window); ``MIXED = False`` keeps the
    Mamba-2 runs apart from attention."""
    m, _ = hybrid()
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(1)), torch.tensor([7])
    seen = []
    handle = m.blocks[2].register_forward_hook(lambda *a: seen.append(1))
    assert_same(steps(m, ids, tok, 3, True, monkeypatch), steps(m, ids, tok, 3, False, monkeypatch))
    assert not calls and len(seen) == 2 * 4
    handle.remove()
    steps(m, ids, tok, 3, True, monkeypatch)
    assert len(calls) == 3                        # the blocks' steps were kept meanwhile: every token in one call
    calls.clear()
    with torch.no_grad():                         # a window set between tokens: the layer's own step from then on
        _, st = m.prefill(ids)
        _, st = m.step(tok, st)
        _, st = m.step(tok, st)
        m.blocks[2].mixer.window = 64
        m.step(tok, st)
        m.blocks[2].mixer.window = None
    assert len(calls) == 2                        # the two tokens before it (the blocks' steps kept already)
    windowed, _ = hybrid(attention={"window": 4})
    assert stack.runs(windowed.blocks) == ((0, 2),)
    monkeypatch.setattr(stack, "MIXED", False)
    assert stack.runs(hybrid()[0].blocks) == ((0, 2),)
