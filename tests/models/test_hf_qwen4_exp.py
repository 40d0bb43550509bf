"""Hugging Face Qwen4-Exp (``qwen4_exp_text``, ``qwen4_exp``): Gated DeltaNet and QSA attention (the indexer's
block selection) in hyper-connected streams, PLE's hashed n-gram embeddings, MoE with a shared expert - the
parity checks are a row of test_hf_parity.py; here what is the type's alone: the multimodal folder, the QSA
selection against a token-by-token float64 reference, PLE's eos rule and decoding state, hyper-connections
against their equations, the compiled step, refusals by name."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_logits_equal, assert_refused, token_ids  # noqa: E402

V = 64
EOS = int(token_ids(V)[0, 7])          # a token the harness's rows hold (twice in the first): PLE's eos rule runs
TYPES = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]
TEXT = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 4, "layer_types": TYPES, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "hc_count": 3, "hc_lowrank": 8,
        "ple_layer_ids": [1, 3], "ple_embed_dim": 24, "ngram_size": 3, "heads_per_ngram": 3,
        "ngram_vocab_size_base": 50, "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 3,
        "ple_conv_kernel_size": 3, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8,
        "indexer_budget": 8, "indexer_compress_ratio": 4, "eos_token_id": EOS, "bos_token_id": None,
        "pad_token_id": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}}


def _noisy(model):
    """Non-trivial norms (zero-centred), time steps, gates and PLE's convolution (transformers starts it at 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "gate.weight", "ple.conv1d.weight",
                              "norm_key.weight", "norm_query.weight", "norm_conv.weight")):
                p.add_(torch.randn_like(p) * 0.3)


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random Qwen4ExpForCausalLM with every option on: GDN, QSA, GDN, QSA; 3 streams; PLE at layers 1 and
    3 (2- and 3-grams, 3 heads each, 3 shards a table); the indexer keeps 2 blocks of 4 tokens plus the tail."""
    torch.manual_seed(0)
    cfg = transformers.Qwen4ExpTextConfig(**{**TEXT, **over})
    cfg._experts_implementation = "eager"                  # its grouped-matmul default has no float64
    model = transformers.Qwen4ExpForCausalLM(cfg).to(dtype).eval()
    _noisy(model)
    folder = tmp_path / "qwen4_exp_text"
    model.save_pretrained(folder)
    return model, folder


LOGITS = {"": {}, "no-ple": {"ple_layer_ids": None}, "sigmoid-gate": {"output_gate_type": "sigmoid"}}
ROUND_TRIP = {"": {}, "sigmoid-gate": {"output_gate_type": "sigmoid"}}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: the structure each config asks for."""
    assert ours.config.layers == ["gated_deltanet", "qsa"] * 2 and ours.config.hyper["streams"] == 3
    ple = ours.config.hyper["ple"]
    assert (ple is None) == ("ple_layer_ids" in over)
    assert [b.ple is not None for b in ours.blocks] == ([False] * 4 if ple is None else [True, False, True, False])
    qsa = ours.blocks[1].mixer
    assert (qsa.index_heads, qsa.index_head_dim, qsa.index_budget, qsa.index_block, qsa.rotary_dim) == (4, 8, 8, 4, 4)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder holds the tables in 3 shards and loads in transformers with nothing missing or
    unexpected."""
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert {f"model.layers.0.ple.ple_embedding.ngram_embedding.shard_{j}.weight" for j in range(3)} <= names
    _, info = transformers.Qwen4ExpForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values())
    assert c["ple_layer_ids"] == [1, 3] and c["layer_types"] == TYPES and c["eos_token_id"] == EOS


# ---------------------------------------------------------------------------------------------- references
def _qsa_reference(layer, x):
    """QSA's equations (``layers.qsa``) token by token: x (1, T, d) -> y (1, T, d), one query at a time."""
    T, H, Hk, K, Hi, D = x.shape[1], layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.index_heads, \
        layer.index_head_dim
    c, keep = layer.index_block, layer.index_budget // layer.index_block
    from subquad.layers.rotary import apply_rotary

    def rot(v, p):
        return apply_rotary(v[None, None, None], p, layer.rotary_base, layer.rotary_dim)[0, 0, 0]

    q, gate = layer.q_proj(x)[0].view(T, H, 2 * K).chunk(2, -1)
    k, v = layer.k_proj(x)[0].view(T, Hk, K), layer.v_proj(x)[0].view(T, Hk, K)
    q, k = layer.q_norm(q), layer.k_norm(k)
    iq, ik = layer.index_qk_proj(x)[0].split([Hi * D, D], -1)
    iq = layer.index_q_norm(iq.view(T, Hi, D))
    out = []
    for p in range(T):
        n = (p + 1) // c
        scores = []
        for b in range(n):
            kb = rot(layer.index_k_norm(ik[b * c:(b + 1) * c].mean(0)), b * c)
            scores.append(sum(max(float(rot(iq[p, h], p) @ kb), 0.0) for h in range(Hi)) / math.sqrt(D))
        best = torch.tensor(scores).topk(min(keep, n)).indices.tolist() if n else []     # transformers' ties
        seen = sorted([j for b in best for j in range(b * c, b * c + c)] + list(range(n * c, p + 1)))
        heads = []
        for h in range(H):
            g = h // (H // Hk)
            qh = rot(q[p, h], p)
            s = torch.stack([qh @ rot(k[j, g], j) for j in seen]) / math.sqrt(K)
            heads.append((s.softmax(0)[:, None] * v[seen, g]).sum(0) * torch.sigmoid(gate[p, h]))
        out.append(layer.o_proj(torch.cat(heads)))
    return torch.stack(out)[None]


def test_qsa_equals_its_equations_token_by_token(tmp_path):
    """The loaded QSA layer's dense masked form equals the selection and attention written one query at a time
    (float64), and its selection differs from full attention (the budget binds)."""
    _, folder = _hf(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    layer = ours.blocks[1].mixer
    x = torch.randn(1, 30, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, _ = layer(x)
        torch.testing.assert_close(got, _qsa_reference(layer, x), rtol=0, atol=1e-12)
        layer.query_chunk = 7                             # the dense path's queries in blocks of 7
        torch.testing.assert_close(layer(x)[0], got, rtol=0, atol=1e-14)
        layer.query_chunk = 512
        iq = layer.index_q_norm(layer.index_qk_proj(x)[..., :32].view(1, 30, 4, 8))
        iq = layer._rotate(iq, torch.arange(30))
        keep = layer.select(iq, layer.index_qk_proj(x)[..., 32:], 0)
    assert keep.sum(-1).max() == 8 + 3 and (~keep[0] & torch.ones(30, 30, dtype=torch.bool).tril()).any()
    with torch.no_grad():                    # decoding's gathered keys (its fast path) against the dense mask
        _, state = layer(x[:, :9])
        for t in range(9, 30):
            fast, new = layer(x[:, t:t + 1], state)
            layer.gather_one = False
            dense, _ = layer(x[:, t:t + 1], state)
            layer.gather_one = True
            torch.testing.assert_close(fast, dense, rtol=0, atol=1e-13)
            state = new


def test_hyper_connections_and_ple_equal_their_equations():
    """A HyperConnection and a PLE layer equal the module doc's equations written out (float64): the streams'
    mix and injection weights; n-grams that stop at eos, the gate, the dilated convolution."""
    from subquad.models.hyper import PLE, HyperConnection

    torch.manual_seed(3)
    d, n = 8, 3
    hc = HyperConnection(d, n, 5, 1e-6).double()
    torch.nn.init.normal_(hc.norm.weight)
    h = torch.randn(2, 7, n * d, dtype=torch.float64)
    x, g = hc(h)
    hn = torch.cat([s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() for s in h.split(d, -1)], -1) * hc.norm.weight
    a = torch.sigmoid(hc.up(torch.nn.functional.silu(hc.down(hn) / n)))
    torch.testing.assert_close(x, sum((a * hn).split(d, -1)) / n, rtol=0, atol=1e-14)
    torch.testing.assert_close(g, 2 * torch.sigmoid(hc.inject(hn) / n), rtol=0, atol=1e-14)

    p = {"layers": [0], "dim": 12, "eos": 2, "ngram": 3, "heads_per_ngram": 3, "conv_size": 2, "vocab_base": 40,
         "vocab_multiple": 8, "seed": 7, "parts": 1}
    ple = PLE(d, n, 1e-6, 20, p, 1).double()
    assert ple.head_sizes.tolist() == [67, 71, 73, 79, 83, 89]        # primes >= 40, the second layer's six
    toks = torch.tensor([[5, 9, 2, 7, 7, 3, 2, 2, 11]])
    ids = ple.ngram_ids(toks)
    for t in range(toks.shape[1]):
        prev = [int(toks[0, t - s]) if t - s >= 0 and 2 not in toks[0, t - s:t].tolist() else 2 for s in range(3)]
        m = [v * int(ple.multipliers[s]) for s, v in enumerate(prev)]
        for j in range(6):
            mixed = m[0] ^ m[1] if j < 3 else m[0] ^ m[1] ^ m[2]
            mixed = (mixed + (1 << 63)) % (1 << 64) - (1 << 63)          # int64 wrap
            assert int(ids[0, t, j]) == mixed % int(ple.head_sizes[j]) + int(ple.head_offsets[j])
    with torch.no_grad():
        ple.conv1d.weight.normal_()
        y, state = ple(h[:1, :5], carry={"tokens": toks[:, :5]})
        y2, _ = ple(h[:1, 5:], state, carry={"tokens": toks[:, 5:7]})
        full, _ = ple(h[:1], carry={"tokens": toks[:, :7]})
    torch.testing.assert_close(torch.cat([y, y2], 1), full, rtol=0, atol=1e-13)


@pytest.mark.filterwarnings("ignore:qwen4_exp")
def test_the_multimodal_folder_loads_its_language_model(tmp_path):
    """A Qwen4ExpForConditionalGeneration folder: the language model loads with transformers' text logits, the
    vision tower named in a warning; it is written back only as qwen4_exp_text."""
    torch.manual_seed(0)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 4, "num_position_embeddings": 16}
    cfg = transformers.Qwen4ExpConfig(text_config=TEXT, vision_config=vision)
    cfg.text_config._experts_implementation = "eager"
    hf = transformers.Qwen4ExpForConditionalGeneration(cfg).eval()
    _noisy(hf)
    hf.save_pretrained(tmp_path / "mm")
    with pytest.warns(UserWarning, match=r"not loaded.*the vision tower \(model\.visual\.\*"):
        ours, _ = from_pretrained(tmp_path / "mm")
    assert_logits_equal(ours, hf, token_ids(V, 24), torch.float32, 1e-4)
    with pytest.raises(ValueError, match="cannot be written as model_type 'qwen4_exp'"):
        save_pretrained(ours, tmp_path / "back", model_type="qwen4_exp")


def test_the_compiled_step_equals_eager_decoding():
    """``compile_decode``'s step gives the eager step's logits with PLE, which reads the tokens from the carry the
    step hands it (a one-layer model: compiling is most of this file's time; QSA's compiled form is the battery's,
    ``check_mixer("qsa", checks=("compile",))``)."""
    from subquad import LanguageModel, ModelConfig
    from subquad.models.decode import compile_decode

    torch.manual_seed(0)
    ple = {"layers": [0], "dim": 8, "eos": 1, "ngram": 3, "heads_per_ngram": 2, "vocab_base": 20, "vocab_multiple": 4}
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, pattern="gated_deltanet", mlp_size=16,
                      hyper={"streams": 2, "rank": 4, "ple": ple},
                      mixer_options={"gated_deltanet": {"n_heads": 2, "head_dim": 8}})
    model = LanguageModel(cfg).eval()
    for b in model.blocks:
        torch.nn.init.normal_(b.ple.conv1d.weight)
    ids = torch.tensor([[3, 1, 5, 7, 9, 2, 4, 1, 6, 8]])
    with torch.no_grad():
        _, state = model.prefill(ids[:, :8])
        want, s = [], state
        for t in (8, 9):
            lt, s = model.step(ids[:, t], s)
            want.append(lt)
        compile_decode(model, cache=False)
        s = state
        for t, w in zip((8, 9), want):
            lt, s = model.step(ids[:, t], s)
            torch.testing.assert_close(lt, w, rtol=0, atol=1e-5)


def test_without_the_indexer_its_attention_is_full_and_read_not_written(tmp_path):
    """A folder without the ``indexer_*`` fields and tensors loads plain gated attention: transformers' logits
    when its indexer's budget holds every token; such a model is not written (transformers builds none)."""
    from safetensors.torch import load_file, save_file

    hf, folder = _hf(tmp_path, indexer_budget=64)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if not k.startswith("indexer_")}))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".indexer." not in k}, str(folder / "model.safetensors"))
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["gated_deltanet", "softmax"] * 2
    assert_logits_equal(ours, hf, token_ids(V, 40), torch.float32, 1e-4)
    with pytest.raises(ValueError, match="no Hugging Face model type has this structure"):
        save_pretrained(ours, tmp_path / "back")


def test_rope_parameters_without_a_rotary_factor_rotate_every_dim(tmp_path):
    """transformers' Qwen4-Exp reads an absent ``partial_rotary_factor`` as 1.0 (Qwen3.5's and Qwen3-Next's configs
    fill in 0.25; this one does not): such a folder - the one transformers writes by default - rotates whole heads."""
    hf, folder = _hf(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert "partial_rotary_factor" not in json.loads((folder / "config.json").read_text())["rope_parameters"]
    ours, _ = from_pretrained(folder)
    assert ours.blocks[1].mixer.rotary_dim == 8
    assert_logits_equal(ours, hf, token_ids(V, 40), torch.float32, 1e-4)


def test_a_model_built_here_saves_as_qwen4_exp_text(tmp_path):
    """A subquad model of this structure (Qwen3.5's gated attention and Gated DeltaNet options, QSA, streams, PLE,
    MoE with a gated shared expert) is written as qwen4_exp_text, and transformers computes its logits."""
    from subquad import LanguageModel, ModelConfig
    from subquad.models.hf.common import gdn_options

    torch.manual_seed(0)
    gdn = gdn_options({"linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8}, 1e-6, False)
    qsa = {"index_heads": 2, "index_head_dim": 8, "index_budget": 4, "index_block": 2, "qk_norm": "head",
           "output_gate": True, "rotary_fraction": 0.5}
    ple = {"layers": [0], "dim": 8, "eos": 1, "ngram": 3, "heads_per_ngram": 2, "vocab_base": 20, "vocab_multiple": 4,
           "parts": 2}
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, pattern="gated_deltanet,qsa", norm_eps=1e-6,
                      hyper={"streams": 2, "rank": 4, "ple": ple}, mixer_options={"gated_deltanet": gdn, "qsa": qsa},
                      moe={"experts": 4, "top_k": 2, "shared": 8, "renormalize": True, "hidden": 8})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "config.json").read_text())["model_type"] == "qwen4_exp_text"
    theirs = transformers.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "mine", experts_implementation="eager")
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_act", "gelu"), ("output_gate_type", "relu"), ("attention_bias", True),
                         ("attn_output_gate", False),
                         ("hc_count", 1), ("indexer_kv_heads", 2), ("indexer_budget", 6),
                         ("layer_types", ["linear_attention", "sliding_attention"] * 2), ("ple_layer_ids", [5]),
                         ("ple_embed_dim", 25)):
        assert_refused(folder, field, {**cfg, field: value})
    assert_refused(folder, "indexer_head_dim", {k: v for k, v in cfg.items() if k != "indexer_head_dim"})
    assert_refused(folder, "eos_token_id", {**cfg, "eos_token_id": None})
