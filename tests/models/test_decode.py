"""The compiled decode step (models.decode) against the eager one: every mixer, every checkpoint type, float32
within 1e-5 of the logits' scale over 64 steps, batches that change size, generate's tokens."""

from __future__ import annotations

import pytest
import torch

from subquad.layers.registry import causal_mixers
from subquad.models import LanguageModel, ModelConfig
from subquad.models.decode import compile_decode

STEPS = 64


def _copy(model):
    """A second model with the same weights (the compiled one; the original stays eager)."""
    other = LanguageModel(model.config).eval()
    other.load_state_dict(model.state_dict())
    return other


def assert_steps_equal(eager, ids, steps=STEPS, tol=1e-5, batches=None, fast=None, cu_seqlens=None):
    """Prefill ``ids`` (B, T) eagerly, then decode ``steps`` greedy tokens with the eager and the compiled step
    (``fast``, else a compiled copy) from the same states: logits within ``tol`` of their largest at every
    step. ``batches`` (step -> rows) drops rows on the way (the batch changes size, as a server's does).
    ``cu_seqlens``: ids (1, T) packs prompts of different lengths, one row each (a ragged batch)."""
    from subquad.models.rows import select_rows

    fast = compile_decode(_copy(eager)) if fast is None else fast
    with torch.no_grad():
        logits, state = eager.prefill(ids, cu_seqlens=cu_seqlens, logits="last")
        s_eager, s_fast = state, state
        tok = logits.argmax(-1)
        for i in range(steps):
            if batches and i in batches:
                rows = batches[i]
                s_eager, s_fast, tok = select_rows(s_eager, rows), select_rows(s_fast, rows), tok[rows]
            a, s_eager = eager.step(tok, s_eager)
            b, s_fast = fast.step(tok, s_fast)
            err = ((b - a).abs().max() / a.abs().max()).item()
            assert err <= tol, f"step {i}: compiled logits differ by {err:.2e} of their scale"
            tok = a.argmax(-1)
    return fast


def whole_model_graphs(fast) -> int:
    """Graphs compiled for ``fast``'s whole step (module doc of models.decode); 0 when a graph break inside a
    layer made dynamo skip it and compile each layer's frames on their own (``aot_compile`` refused the model:
    the step runs torch.compile's graphs)."""
    if fast._decode_step.fallback is None:
        return len(fast._decode_step.graphs)        # saved or loaded graphs, one per specialisation
    code = fast._decode_step.graph._torchdynamo_orig_callable.__code__
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


GROUPS = 3      # every causal mixer has a layer in one of three models: three tests the workers share


@pytest.mark.parametrize("group", range(GROUPS))
def test_every_mixer_in_a_model_and_a_batch_that_shrinks(group):
    """One layer of every causal mixer (a third of them per model) and learned positions: batch 3 from an odd
    prompt length, then rows leave at steps 20 and 40 (a KV cache and the batch change size under the graph;
    batch 1 is a graph of its own: dynamo specialises sizes of 1). No mixture of experts here: at a batch with
    more choices than experts its routed loop runs eagerly, a graph break that makes dynamo compile every
    block's frames one by one (test_a_moe_layer_in_a_batch_that_shrinks takes that path on three layers).
    Mamba in two heads (Zamba's, a scan per head; one head: the mamba checkpoint types'); softmax attention with
    LFM3's per-head gate, and its group in LFM3's sandwich-norm blocks; MLA with Ling's per-head gate, KDA with its
    full-rank gates and bounded decay."""
    torch.manual_seed(group)
    names = _grouped()[group::GROUPS]
    options = {"swa": {"window": 8}, "mamba": {"heads": 2}, "softmax": {"head_gate": True}, "mla": {"head_gate": True},
               "kda": {"full_gates": True, "gate_bound": -5.0}}
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=len(names), n_heads=2, pattern=",".join(names),
                      context_length=512, pos_emb="learned", sandwich_norm="softmax" in names,
                      mixer_options={k: v for k, v in options.items() if k in names})
    eager = LanguageModel(cfg).eval()
    fast = assert_steps_equal(eager, torch.randint(0, 128, (3, 11)), batches={20: [0, 2], 40: [1]})
    # no layer breaks the whole-model graph (a float check in linear attention once did: dynamo then skipped
    # it and compiled ~100 graphs of this model's frames), and nothing recompiles it but batch 1 (dynamo
    # specialises sizes of 1): a state's structure is the same at every step (models.decode._for_graph)
    assert whole_model_graphs(fast) == 2


def _grouped() -> list:
    """The causal mixers of the three models: all but QSA, tested on its own -
    test_indexed_attention_decodes_in_one_graph (a ragged batch from prompts of different lengths)."""
    return sorted(set(causal_mixers()) - {"qsa"})


def test_the_groups_hold_every_causal_mixer():
    assert sorted(sum((_grouped()[g::GROUPS] for g in range(GROUPS)), []) + ["qsa"]) == sorted(causal_mixers())


def test_indexed_attention_decodes_in_one_graph():
    """QSA (Qwen4-Exp's indexed attention) alone, past its budget (selection matters), a ragged batch of 3 (prompts
    of 3, 11 and 6 tokens: each row at its own position, all rows at once - ``IndexedAttention._ragged``): the
    compiled steps equal the eager ones, in one graph - no break, as the cache grows (a slice of the S index keys
    once guarded on S's parity: a second graph). (Batch 1's graph is the battery's and test_hf_qwen4_exp's.)"""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, pattern="qsa", context_length=512,
                      mixer_options={"qsa": {"index_head_dim": 16, "index_budget": 4, "index_block": 2,
                                             "rotary_fraction": 0.5}})
    eager = LanguageModel(cfg).eval()
    fast = assert_steps_equal(eager, torch.randint(0, 128, (1, 20)), steps=6, cu_seqlens=torch.tensor([0, 3, 14, 20]))
    assert fast._decode_step.fallback is None and whole_model_graphs(fast) == 1


def test_a_moe_layer_in_a_batch_that_shrinks():
    """A mixture of experts between a recurrent and an attention layer: at batch 9 (18 choices of 4 experts,
    over ``moe.GATHER`` * 4) its routed loop runs as an op inside the graph, at batch 2 and 1 by index - the
    shrinking batch takes both, in three whole-model graphs; the checkpoint types' MoE variants (shared
    experts, grouped routing, scaled residuals) are test_every_checkpoint_type's."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=2, pattern="mamba2,gla,softmax",
                      context_length=512, moe={"experts": 4, "top_k": 2, "layers": [1]})
    eager = LanguageModel(cfg).eval()
    fast = assert_steps_equal(eager, torch.randint(0, 128, (9, 11)), batches={20: [0, 2], 40: [1]})
    assert whole_model_graphs(fast) == 3


def test_generate_takes_the_compiled_step_and_gives_eager_tokens():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, pattern="gla,softmax", context_length=512)
    eager = LanguageModel(cfg).eval()
    fast = compile_decode(_copy(eager))
    calls = []
    inner = fast._decode_step
    fast._decode_step = lambda t, s: calls.append(1) or inner(t, s)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
        want, _ = eager.generate(prompts, 20, temperature=0)
        got, _ = fast.generate(prompts, 20, temperature=0)
    finally:
        fast._decode_step = inner
    assert got == want and len(calls) == 19
    from subquad.models.rows import select_rows

    graphs = whole_model_graphs(fast)
    logits, state = fast.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]), logits="last")    # gradients on
    state = select_rows(state, [1, 0], capacity=64)                  # a KV cache with room, made with gradients
    assert all(v.requires_grad for v in (state[0]["S"], state[1]["kv"].k)), state
    for _ in range(2):
        logits, state = fast.step(logits.argmax(-1), state)
    assert whole_model_graphs(fast) == graphs        # the same graph: states taken without autograd history
    other = _copy(eager)
    assert compile_decode(compile_decode(other), False)._decode_step is None
    with pytest.raises(ValueError, match="on must be a bool"):
        compile_decode(other, "yes")


def test_faster_keeps_the_step_that_timed_faster_for_each_batch_class(monkeypatch, capsys):
    """``compile_decode(faster=True)``: for one row and for several, the compiled and the eager step take turns
    (one untimed step of each, then TRIAL timed) and the faster is kept - here the compiled one made 20 ms
    slower for one row, the eager one for several; tokens equal the eager model's throughout. The choice is what
    is tested: the "compiled" step runs the eager one (the graphs are test_every_mixer_..., ~10 s a compile)."""
    import time

    from subquad.models.decode import CompiledStep

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, pattern="gla,softmax", context_length=512)
    eager = LanguageModel(cfg).eval()
    fast = compile_decode(_copy(eager), faster=True, cache=False)
    ran = []
    plain = CompiledStep._eager

    def slow_compiled(self, tokens, state):
        ran.append(("compiled", tokens.shape[0]))
        if tokens.shape[0] == 1:
            time.sleep(0.02)
        return plain(self, tokens, state)

    def slow_eager(self, tokens, state):
        ran.append(("eager", tokens.shape[0]))
        if tokens.shape[0] > 1:
            time.sleep(0.02)
        return plain(self, tokens, state)
    monkeypatch.setattr(CompiledStep, "_compiled", slow_compiled)
    monkeypatch.setattr(CompiledStep, "_eager", slow_eager)
    trial = 2 * (CompiledStep.TRIAL + 1)
    for prompts in ([[1, 2, 3]], [[1, 2, 3], [4, 5, 6, 7, 8]]):
        ran.clear()
        want, _ = eager.generate(prompts, trial + 6, temperature=0)
        assert fast.generate(prompts, trial + 6, temperature=0)[0] == want
        kinds = [k for k, _ in ran]
        assert kinds[:trial] == ["compiled", "eager"] * (CompiledStep.TRIAL + 1)
        assert set(kinds[trial:]) == {"eager" if len(prompts) == 1 else "compiled"} and len(kinds) == trial + 5
    assert fast._decode_step.chosen == {"1": "eager", "B": "compiled"}
    from subquad.cli.generate import report_compiled  # subquad generate --compile-decode says so

    report_compiled(fast)
    said = capsys.readouterr().err
    assert "one row: kept the eager step" in said and "several rows: kept the compiled step" in said
    one = fast._decode_step.trial["1"]
    assert f"eager {1e3 * min(one['eager']):.2f} ms, compiled {1e3 * min(one['compiled']):.2f} ms" in said
    assert fast._decode_step.verifier().trial is None                 # a verification always takes its graph
    plain_fast = compile_decode(_copy(eager), cache=False)             # without faster: the graph at every step
    ran.clear()
    plain_fast.generate([[1, 2, 3]], 6, temperature=0)
    assert [k for k, _ in ran] == ["compiled"] * 5 and plain_fast._decode_step.chosen == {}
    with pytest.raises(ValueError, match="faster must be a bool"):
        compile_decode(_copy(eager), faster="yes")


# Each parity test's model, cut to one layer of each kind it holds (mixer, dense MLP or MoE; the first and a
# later RWKV-7 layer): the layers beyond repeat one already compiled, and each compiles a graph of its own.
FEWER = {"mamba": {"num_hidden_layers": 1}, "falcon_mamba": {"num_hidden_layers": 1},
         "mamba2": {"num_hidden_layers": 1},
         "bamba": {"num_hidden_layers": 2},                                  # Mamba-2, then attention (layer 1)
         "jamba": {"num_hidden_layers": 3},                                  # Mamba dense, Mamba MoE, attention
         "qwen3_next": {"num_hidden_layers": 2},                             # Gated DeltaNet dense, attention MoE
         "olmo_hybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
         "kimi_linear": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
         "minimax": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
         "zamba2": {"num_hidden_layers": 2, "layers_block_type": ["mamba", "hybrid"], "num_mem_blocks": 1}}


def _checkpoint(kind, tmp_path, monkeypatch):
    """A tiny random folder of checkpoint type ``kind`` (the parity tests' builders, with ``FEWER`` layers)."""
    from tests.models import test_hf, test_hf_delta, test_hf_hybrid, test_hf_kimi, test_hf_minimax

    over = FEWER.get(kind, {})
    if kind in test_hf.KINDS:
        return test_hf._hf_mamba(tmp_path, falcon=kind, **over)[1], 64
    if kind in test_hf_hybrid.KINDS:
        return test_hf_hybrid._hf(tmp_path, kind, **over)[1], test_hf_hybrid.V
    if kind in test_hf_delta.KINDS:
        return test_hf_delta._hf(tmp_path, kind, **over)[1], test_hf_delta.V
    if kind == "kimi_linear":
        return test_hf_kimi._hf(tmp_path, **over)[1], test_hf_kimi.V
    if kind == "zamba2":
        from tests.models import test_hf_zamba2

        return test_hf_zamba2._hf(tmp_path, **over)[1], test_hf_zamba2.V
    if kind == "rwkv7":
        from tests.models import test_rwkv7

        monkeypatch.setattr(test_rwkv7, "L", 2)         # layer 0 (ln0, no value lora) and one that mixes in v_first
        test_rwkv7.fla_folder(test_rwkv7.random_pth(tmp_path / "model.pth"), tmp_path / "rwkv7")
        return tmp_path / "rwkv7", test_rwkv7.V
    return test_hf_minimax._hf(tmp_path, **over)[1], test_hf_minimax.V


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "qwen3_next", "olmo_hybrid",
                                  "kimi_linear", "minimax", "rwkv7", "zamba2"])
def test_every_checkpoint_type(tmp_path, monkeypatch, kind):
    pytest.importorskip("transformers")
    from subquad.models import from_pretrained
    from subquad.models.hf import MAPPINGS

    assert kind in MAPPINGS
    folder, V = _checkpoint(kind, tmp_path, monkeypatch)
    model, _ = from_pretrained(folder)
    n = model.config.n_layers
    assert n == FEWER.get(kind, {}).get("num_hidden_layers", 2), n      # rwkv7: 2 (test_rwkv7.L patched)
    fast = assert_steps_equal(model, torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3)))
    assert whole_model_graphs(fast) == 1            # MoE types too: at 2 rows x k > E the loop is an op in it
