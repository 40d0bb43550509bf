"""models.stack: a decoding token's Mamba / Mamba-2 blocks in one C call - equal, bit for bit, to the blocks one
by one (whose own tests hold them to float64), and to a float64 model's step; every change the blocks would see
is seen."""

from __future__ import annotations

import pytest
import torch

from subquad import kernels
from subquad.layers.mamba import STACKS
from subquad.models import stack, token_step
from subquad.models.quant import quantize
from subquad.models.state import save_state
from subquad.ops.mamba import fused_block
from tests.ops.fused_harness import count_calls, models

pytestmark = pytest.mark.skipif(not fused_block.STACK.available(), reason="no C compiler: the kernel cannot be built")

PATTERNS = {"mamba": dict(d_model=48, n_layers=3, pattern="mamba"),
            "mamba heads": dict(d_model=48, n_layers=2, pattern="mamba", mixer_options={"mamba": {"heads": 2}}),
            "mamba2": dict(d_model=64, n_layers=3, pattern="mamba2")}


@pytest.fixture(autouse=True)
def head_through_the_modules():
    """The head's call (``models.token_step``) sums in another order than the norm and head modules: off in this
    file's tests (not through monkeypatch: some undo theirs), so the stack on and off compare bit for bit."""
    was, token_step.ENABLED = token_step.ENABLED, False
    yield
    token_step.ENABLED = was


def counted(monkeypatch):
    """How often the stack kernel runs."""
    return count_calls(monkeypatch, stack.mamba_block.StackStep)


def steps(m, ids, tok, n, enabled, monkeypatch, module=stack):
    """n greedy steps after prefilling ids with ``module.ENABLED`` set to ``enabled`` -> [(logits, state) per
    step]. Switching the stack, the head's call (``models.token_step``, whose norm and product sum in another
    order than the modules) stays off, so the logits compare bit for bit."""
    if module is stack:
        monkeypatch.setattr(token_step, "ENABLED", False)
    monkeypatch.setattr(module, "ENABLED", enabled)
    out = []
    with torch.no_grad():
        _, st = m.prefill(ids)
        for _ in range(n):
            logits, st = m.step(tok, st)
            out.append((logits, st))
            tok = logits.argmax(-1)
    return out


def assert_near_float64(m64, ids, tok, out):
    """Each step's logits within 1e-5 of the logits' scale of an independent computation: the float64 model's
    forward over the whole sequence at once."""
    with torch.no_grad():
        seq = torch.cat([ids] + [torch.stack([tok] + [lg.argmax(-1) for lg, _ in out[:-1]], 1)], 1)
        full = m64(seq)[:, ids.shape[1]:]
    for i, (logits, _) in enumerate(out):
        assert (logits.double() - full[:, i]).abs().max() <= 1e-5 * full.abs().max()


def assert_same(a, b):
    for (la, sa), (lb, sb) in zip(a, b):
        assert torch.equal(la, lb)
        for x, y in zip(sa, sb):
            assert x.keys() == y.keys()
            for k in x:                          # a tensor, or an attention layer's KV cache
                a, b = (x[k], y[k]) if isinstance(x[k], torch.Tensor) else ((x[k].k, x[k].v), (y[k].k, y[k].v))
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else all(map(torch.equal, a, b))


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("B", [1, 3])
def test_the_blocks_in_one_call_equal_them_one_by_one_and_float64(monkeypatch, name, B):
    m, m64 = models(**PATTERNS[name])
    ids = torch.randint(0, 300, (B, 7), generator=torch.Generator().manual_seed(B))
    tok = torch.tensor([4, 100, 299][:B])
    calls = counted(monkeypatch)
    one = steps(m, ids, tok, 4, True, monkeypatch)
    assert len(calls) == 3                        # the first token builds the blocks' steps, then one call each
    assert_same(one, steps(m, ids, tok, 4, False, monkeypatch))
    assert_near_float64(m64, ids, tok, one)


HYBRID = dict(d_model=64, n_layers=7, pattern="mamba2,mamba2,mamba2,softmax,mamba2,mamba2,softmax", mlp=True,
              mlp_size=96, n_heads=4, mixer_options={"mamba2": {"d_state": 16, "head_dim": 16}})


@pytest.mark.parametrize("B,kind", [(1, "swiglu"), (3, "swiglu"), (3, "relu2")])
def test_a_hybrids_runs_of_blocks_with_mlps_equal_them_one_by_one_and_float64(monkeypatch, B, kind):
    """Bamba's structure: runs of Mamba-2 blocks with a SwiGLU each (layers 0-2, 4-5; Nemotron-H's ReLU^2 too) in
    one call each, the attention blocks between them as usual (``MIXED`` off: with it the whole run is one call,
    tests/models/test_layer_stack.py) - bit-equal to the blocks one by one, within 1e-5 of a float64 forward of
    the whole sequence."""
    from subquad.ops import mlp_block

    monkeypatch.setattr(stack, "MIXED", False)
    assert stack.runs(models(**HYBRID)[0].blocks) == ((0, 3), (4, 6))
    m, m64 = models(**HYBRID, mlp_kind=kind)
    ids = torch.randint(0, 300, (B, 7), generator=torch.Generator().manual_seed(B))
    tok = torch.tensor([4, 100, 299][:B])
    calls = counted(monkeypatch)
    mlps = []
    run = mlp_block.MlpStep.__call__
    monkeypatch.setattr(mlp_block.MlpStep, "__call__", lambda self, h: mlps.append(1) or run(self, h))
    one = steps(m, ids, tok, 4, True, monkeypatch)
    assert len(calls) == 2 * 3                    # the first token builds the steps, then one call a run
    assert len(mlps) == 7 + 3 * 2                 # the first token's MLPs, then the attention blocks'
    assert_same(one, steps(m, ids, tok, 4, False, monkeypatch))
    assert_near_float64(m64, ids, tok, one)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantised_hybrid_and_a_hooked_mlp(monkeypatch, kind):
    """int8 / int4 MLPs and mixers in the runs equal the blocks one by one; a hook on an MLP runs its run's
    blocks one by one (the hook runs), the other run still in one call; a replaced MLP weight is read (``MIXED``
    off)."""
    monkeypatch.setattr(stack, "MIXED", False)
    m, _ = models(**dict(HYBRID, mlp_size=128))
    quantize(m, kind, group_size=32) if kind == "int4" else quantize(m, kind)
    ids, tok = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])
    calls = counted(monkeypatch)
    assert_same(steps(m, ids, tok, 3, True, monkeypatch), steps(m, ids, tok, 3, False, monkeypatch))
    assert len(calls) == 2 * 2
    seen = []
    handle = m.blocks[4].mlp.register_forward_hook(lambda *a: seen.append(1))
    calls.clear()
    assert_same(steps(m, ids, tok, 3, True, monkeypatch), steps(m, ids, tok, 3, False, monkeypatch))
    assert len(calls) == 3 and len(seen) == 2 * (1 + 3)    # the first run, kept; the hook: prefill, 3 steps, twice
    handle.remove()


def test_a_quantised_model_and_a_change_of_weights_between_tokens(monkeypatch):
    """int8 projections (the kernels' kind 2) take it too; weights replaced between tokens (``.data =``, a new
    module, ``quantize``) are read at the next token, as the blocks one by one read them."""
    m, _ = models(d_model=64, n_layers=2, pattern="mamba")
    ids, tok = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 9])
    calls = counted(monkeypatch)

    def run(enabled):
        monkeypatch.setattr(stack, "ENABLED", enabled)
        with torch.no_grad():
            _, st = m.prefill(ids)
            a, st = m.step(tok, st)
            b, st = m.step(tok, st)
            m.blocks[1].mixer.out_proj.weight.data = m.blocks[1].mixer.out_proj.weight.data * 2   # a new tensor
            c, st = m.step(tok, st)
            d, st = m.step(tok, st)
            m.blocks[1].mixer.out_proj.weight.data = m.blocks[1].mixer.out_proj.weight.data / 2
            return a, b, c, d

    on = run(True)
    assert len(calls) == 2                        # steps 2 and 4; step 3 ran the blocks (their plans rebuilt)
    assert all(torch.equal(x, y) for x, y in zip(on, run(False)))
    assert not torch.equal(on[1], on[3])
    quantize(m, "int8")
    calls.clear()
    assert all(torch.equal(x, y) for x, y in zip(run(True), run(False)))
    assert calls


def test_what_keeps_the_blocks_one_by_one(monkeypatch):
    """A hook on a block or a mixer (it must run), a model with another kind of block, and a compiled or
    verification backend run the blocks one by one; the states passed in are never written and the new ones
    are tensors of their own (a state saves)."""
    m, _ = models(d_model=48, n_layers=2, pattern="mamba")
    calls = counted(monkeypatch)
    ids, tok = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2)), torch.tensor([7])
    with torch.no_grad():
        _, st = m.prefill(ids)
        _, st = m.step(tok, st)
        before = [{k: v.clone() for k, v in s.items()} for s in st]
        _, new = m.step(tok, st)
        assert len(calls) == 1
        assert all(torch.equal(s[k], b[k]) for s, b in zip(st, before) for k in s)
        save_state("/dev/null", new)              # no two tensors share memory (safetensors refuses that)
        seen = []
        for mod in (m.blocks[0], m.blocks[1].mixer):
            handle = mod.register_forward_hook(lambda *a: seen.append(1))
            m.step(tok, st)
            handle.remove()
        assert len(calls) == 1 and len(seen) == 2
        m.step(tok, st)
        assert len(calls) == 2
    hybrid, _ = models(d_model=48, n_layers=2, pattern="mamba,softmax")
    with torch.no_grad():
        _, st = hybrid.prefill(ids)
        for _ in range(3):
            _, st = hybrid.step(tok, st)
    assert len(calls) == 2 and STACKS[hybrid.blocks] == {"structure": (tuple(hybrid.blocks), ())}   # no run


def test_autocast_and_compiling_keep_the_blocks_one_by_one(monkeypatch):
    """Under bf16 autocast (the products' outputs would be bf16) and while compiling (inductor fuses the blocks
    itself) the stack does not run; afterwards it does again."""
    m, _ = models(d_model=48, n_layers=2, pattern="mamba")
    calls = counted(monkeypatch)
    tok = torch.tensor([7])
    with torch.no_grad():
        _, st = m.prefill(torch.tensor([[1, 2, 3]]))
        _, st = m.step(tok, st)                   # the blocks' steps kept
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m.step(tok, st)
        assert not calls
        with monkeypatch.context() as p:
            p.setattr(torch.compiler, "is_compiling", lambda: True)
            assert stack.stacked_blocks(m.blocks, m.embed(tok.view(1, 1)), st) is None
        m.step(tok, st)
        assert len(calls) == 1


def test_a_steady_span_checks_once_until_renewed(monkeypatch):
    """Inside ``kernels.steady()`` the kept calls are checked at the first token only: a weight swapped with
    ``.data =`` is read from the first token after ``renew()`` (the old one, kept alive, until then), and at once
    outside any span - each time as the blocks one by one, checked at every token outside a span, read it."""
    m, _ = models(d_model=64, n_layers=2, pattern="mamba")
    ids, tok = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(3)), torch.tensor([11])
    w = m.blocks[1].mixer.out_proj.weight

    def run(enabled, span, swap_at, renew_at=None):
        """Logits of 5 steps, the weight replaced by a doubled copy before step ``swap_at``."""
        monkeypatch.setattr(stack, "ENABLED", enabled)
        out, keep = [], w.data
        with torch.no_grad(), kernels.steady() as s:
            if not span:
                monkeypatch.setattr(kernels, "steady_mark", lambda: None)     # as outside a span
            _, st = m.prefill(ids)
            for i in range(5):
                if i == swap_at:
                    w.data = keep.clone() * 2
                    if span:
                        del keep                           # only the kept calls still hold the old weights
                if i == renew_at:
                    s.renew()
                logits, st = m.step(tok, st)
                out.append(logits)
        monkeypatch.undo()
        return out

    keep = w.data
    calls = counted(monkeypatch)
    steady = run(True, True, swap_at=2, renew_at=4)
    w.data = keep
    assert calls
    late = run(False, False, swap_at=4)                    # one by one: the swap read from step 4
    w.data = keep
    assert all(torch.equal(a, b) for a, b in zip(steady, late))
    fresh = run(False, False, swap_at=2)
    w.data = keep
    assert not torch.equal(fresh[2], late[2])              # the swap matters
    calls = counted(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(run(True, False, swap_at=2), fresh))  # outside a span: at once
    w.data = keep
    assert calls


def test_generate_sees_a_change_its_on_token_makes(monkeypatch):
    """``generate`` decodes in a steady span renewed after each ``on_token``: weights the callback swaps are read
    at the next token, as a loop of ``step`` outside any span reads them."""
    m, _ = models(d_model=64, n_layers=2, pattern="mamba2")
    prompt = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    w = m.blocks[0].mixer.out_proj.weight
    keep = w.data

    def on_token(t, seen=[]):
        seen.append(t)
        if len(seen) == 3:
            w.data = keep * -3

    got, _ = m.generate(prompt, 6, temperature=0.0, on_token=on_token)
    w.data = keep
    ref = []
    with torch.no_grad():
        logits, st = m.prefill(torch.tensor([prompt]), logits="last")
        while True:
            t = int(logits.argmax(-1))
            ref.append(t)
            if len(ref) == 3:
                w.data = keep * -3
            if len(ref) == 6:
                break
            logits, st = m.step(torch.tensor([t]), st)
    w.data = keep
    assert got == ref
    without, _ = m.generate(prompt, 6, temperature=0.0)
    assert without[:3] == ref[:3] and without != ref       # the change mattered
