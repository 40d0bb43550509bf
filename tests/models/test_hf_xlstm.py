"""Hugging Face ``xlstm`` (xLSTM-7B's mLSTM blocks): what is this type's alone; the logits, decoding, packing,
greedy and round-trip checks are its row of ``test_hf_parity.py``.

transformers 5.24 cannot build or load a ``weight_mode="fused"`` model (its ``_init_weights`` slices the fused
gate bias with the wrong size), so a fused folder is written here from a single-mode model's weights and that
model is its reference; and its cache is sized from ``qk_dim`` rounded up to 64, so at other widths its decoding
fails: there its forward without a cache is the reference."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny, token_ids  # noqa: E402

V = 96
LOGITS = {"": {}, "bias": {"use_bias": True}, "fused-bias": {"fused": True, "use_bias": True}}
ROUND_TRIP = {"": {}, "bias": {"use_bias": True}}


def _fuse(folder):
    """Rewrite a single-mode folder as ``weight_mode="fused"``: q, k, v and the output gate in ``qkv_opreact``, the
    two gates in ``ifgate_preact``, the SwiGLU's inputs in ``proj_up_gate_z`` (NX-AI's fused layout)."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    fused = {"mlstm_layer.qkv_opreact": ["mlstm_layer.q", "mlstm_layer.k", "mlstm_layer.v", "mlstm_layer.ogate_preact"],
             "mlstm_layer.ifgate_preact": ["mlstm_layer.igate_preact", "mlstm_layer.fgate_preact"],
             "ffn.proj_up_gate_z": ["ffn.proj_up_gate", "ffn.proj_up"]}
    out = dict(w)
    for i in range(json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
        p = f"backbone.blocks.{i}."
        for new, parts in fused.items():
            for tail in ("weight", "bias"):
                if f"{p}{parts[0]}.{tail}" in w:
                    out[f"{p}{new}.{tail}"] = torch.cat([out.pop(f"{p}{part}.{tail}") for part in parts])
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "weight_mode": "fused"}))


def _hf(tmp_path, dtype=torch.float32, fused=False, **over):
    """Two blocks of width 128 (q, k 64 wide: transformers' cache needs a multiple of 64), two heads, a SwiGLU of
    192 (1.5 x 128 rounded to 16), chunks of 8 (transformers runs 6 whole chunks of the 50 tokens, then its token
    loop); gates that depend on the input (transformers starts their weights at zero) and input-gate biases ~ N(0, 4)
    (exp(i) up to e^15: the stabiliser at work), non-trivial norms; the gate and logit soft caps (15, 30) on. Norms
    reduced in the model's dtype (``norm_reduction_force_float32`` off): transformers' float64 is then float32 only
    in its final norm and its token loop's state (``inference_state_dtype``, float32 at best), 2e-7 of the logits
    here instead of 9e-7."""
    def tweak(m):
        for n, p in m.named_parameters():
            if n.endswith("igate_preact.bias"):
                p.normal_(0, 4)

    hf, folder = tiny(tmp_path, "xlstm", transformers.xLSTMConfig, transformers.xLSTMForCausalLM, {
        "vocab_size": V, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 2, "chunk_size": 8,
        "ffn_proj_factor": 1.5, "ffn_round_up_to_multiple_of": 16, "norm_reduction_force_float32": False, **over},
        dtype, ("norm.weight", "norm_mlstm.weight", "norm_ffn.weight", "gate_preact.weight", "bias"), tweak=tweak)
    if fused:
        _fuse(folder)
    return hf, folder


def _hf_logits(hf, ids):
    """transformers' logits in the model's dtype: its forward casts them to float32 (``.float()``) before the
    soft cap, which would bound a float64 comparison at float32's rounding."""
    with torch.no_grad():
        logits = hf.lm_head(hf.backbone(ids, use_cache=False).last_hidden_state)
    cap = hf.config.output_logit_soft_cap
    return logits if cap is None else cap * torch.tanh(logits / cap)


def test_the_loaded_structure(tmp_path):
    """A fused folder with the released xLSTM-7B's kernel fields (NX-AI's Triton kernels: the same mLSTM), biases on."""
    _, folder = _hf(tmp_path, fused=True, use_bias=True)
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "chunkwise_kernel": "chunkwise--triton_xl_chunk",
                                                    "sequence_kernel": "native_sequence__triton",
                                                    "step_kernel": "triton", "autocast_kernel_dtype": "bfloat16"}))
    ours, _ = from_pretrained(folder)
    c = ours.config
    assert (c.layers, c.mlp_hidden, c.logit_soft_cap, c.tie_embeddings) == (["mlstm", "mlstm"], 192, 30.0, False)
    m = ours.blocks[0].mixer
    assert (m.n_heads, m.head_k, m.head_v, m.gate_soft_cap, m.chunk_size) == (2, 32, 64, 15.0, 8)
    assert (c.norm_bias, c.mlp_bias, m.q_proj.bias is not None, ours.norm.bias) == (True, True, True, None)


def test_logits_where_transformers_cannot_decode(tmp_path):
    """Width 64: q, k 32 wide, which transformers' cache (64 rounded) cannot hold; its forward without a cache is
    the reference, float64 to 1e-6 of its logits' size as in the table (transformers' float64 is float32 in places:
    ``_hf``)."""
    hf, folder = _hf(tmp_path, torch.float64, hidden_size=64, num_heads=4)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    ids = token_ids(V)
    ref = _hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_a_fused_folder_saves_single_and_transformers_loads_it(tmp_path):
    hf, folder = _hf(tmp_path, fused=True)
    ours, _ = from_pretrained(folder)
    save_pretrained(ours, tmp_path / "back")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (c["weight_mode"], c["model_type"]) == ("single", "xlstm")
    again = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = token_ids(V)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_a_model_built_here_saves_as_xlstm(tmp_path):
    from subquad import LanguageModel, ModelConfig

    cfg = ModelConfig(vocab_size=V, d_model=128, n_layers=2, n_heads=2, pattern="mlstm", mlp_size=176,
                      tie_embeddings=False, logit_soft_cap=30.0, mixer_options={"mlstm": {"chunk_size": 8}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "config.json").read_text())["model_type"] == "xlstm"
    theirs = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "mine").eval()
    ids = token_ids(V)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    from subquad import ModelConfig

    with pytest.raises(ValueError, match="norm_bias"):            # a LayerNorm has its bias already
        ModelConfig(norm="layer", norm_bias=True)

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("use_bias", "yes"), ("add_out_norm", False), ("weight_mode", "split"), ("num_heads", 3),
                         ("qk_dim_factor", 0.0), ("embedding_dim", 96), ("gate_soft_cap", -1.0),
                         ("ffn_round_up_to_multiple_of", 0), ("num_heads", "2")):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = dict(load_file(str(folder / "model.safetensors")))
    del w["backbone.blocks.1.mlstm_layer.fgate_preact.bias"]
    assert_refused(folder, "missing.*blocks.1.mlstm_layer.fgate_preact.bias", weights=w)
