"""Ling 3's (``bailing_hybrid``) multi-token-prediction head (``models.mtp``): a tiny random Ling saved by
transformers, given an MTP layer under the published names - "model.layers.{num_hidden_layers}.": one decoder
layer (MLA and the MoE) with ``enorm``, ``hnorm``, ``eh_proj`` and ``final_layernorm`` (SGLang's
``bailing_moe_nextn.py`` reading). The reference is that layout written out in float64 around transformers' own
Ling decoder layer holding the same weights (transformers has no MTP forward: it skips those layers on load)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it)

from safetensors.torch import load_file, save_file  # noqa: E402

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models import test_hf_bailing_hybrid as ling  # noqa: E402
from tests.models.mtp_harness import (assert_batch_speculation_is_plain, assert_head_equals, causal, first,  # noqa: E402
                                      graft, random_head, reference, speculate_recording)

pytestmark = pytest.mark.usefixtures("unpaced")     # counts verifications: no pacing by wall time

SRC = 2                # the tiny model's MLA layer with experts: the MTP layer copies its shape
N = 3                  # its num_hidden_layers: the MTP layer's index
MTP = f"model.layers.{N}."


def _ids(T, seed=1):
    return torch.randint(0, ling.V, (1, T), generator=torch.Generator().manual_seed(seed))


def _with_mtp(tmp_path, dtype=torch.float64):
    """(transformers' model, a reference ``mtp(h, tokens)`` -> (logits, u), the folder) of a tiny Ling whose MTP
    layer is a perturbed copy of layer 2 (MLA, MoE) with random ``enorm``, ``hnorm``, ``eh_proj`` and
    ``final_layernorm``."""
    hf, folder = ling._hf(tmp_path, dtype)
    (layer,) = graft(hf, tmp_path, folder, [(lambda t: t.model.layers[SRC], f"model.layers.{SRC}.", MTP)],
                     buffers=True)
    assert layer.block_type == "full_attention" and layer.mlp.__class__.__name__ == "BailingHybridMoE"
    RMS = transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNorm
    names = {"embed": f"{MTP}enorm.weight", "hidden": f"{MTP}hnorm.weight", "final": f"{MTP}final_layernorm.weight"}
    norms, eh = random_head(folder, RMS, hf.config.hidden_size, hf.config.rms_norm_eps, names, f"{MTP}eh_proj.weight",
                            dtype, centre=1.0)
    lm = hf.model

    def run(z, T):
        pos = torch.arange(T)[None]
        return first(layer(z, position_embeddings=lm.rotary_emb(z, pos), attention_mask=causal(T, z.dtype),
                           position_ids=pos))

    return hf, reference(lm.embed_tokens, hf.lm_head, norms, eh, run), folder


def test_the_mtp_head_equals_the_layout_written_out_and_saves_back(tmp_path):
    """The MTP layer loads as ``model.mtp`` (MLA, the MoE): every pair's logits within 1e-6 of the reference, all at
    once and in two pieces from the head's state; a saved folder holds the same names, declares the layer, loads
    again with the same head, and transformers loads it (skipping the layer) with the same logits."""
    hf, mtp, folder = _with_mtp(tmp_path)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.mtp is not None and ours.mtp.block.mlp.__class__.__name__ == "MoE"
    assert ours.mtp.block.mixer.__class__.__name__ == "LatentAttention" and ours.mtp.block.mixer.g_proj is not None
    ids = _ids(21)
    with torch.no_grad():
        mine, got = assert_head_equals(ours, hf.model(ids).last_hidden_state, ids, mtp)
    save_pretrained(ours, tmp_path / "back")
    c = json.loads((tmp_path / "back" / "config.json").read_text())
    assert c["num_nextn_predict_layers"] == 1 and c["num_hidden_layers"] == N
    saved = load_file(str(tmp_path / "back" / "model.safetensors"))
    source = load_file(str(folder / "model.safetensors"))
    assert set(saved) == set(source)
    for k in (f"{MTP}attention.q_proj.weight", f"{MTP}attention.kv_a_proj_with_mqa.weight", f"{MTP}eh_proj.weight"):
        torch.testing.assert_close(saved[k], source[k], rtol=0, atol=0)         # rotary rows back in their order
    back, _ = from_pretrained(tmp_path / "back", dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(back.mtp(back, mine[:, :-1], ids[:, 1:])[0], got, rtol=0, atol=0)
    kw = {"dtype": torch.float64, "experts_implementation": "eager", "output_loading_info": True}
    again, info = transformers.BailingHybridForCausalLM.from_pretrained(tmp_path / "back", **kw)
    first_load, _ = transformers.BailingHybridForCausalLM.from_pretrained(folder, **kw)   # its float32 modules as here
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids).logits, first_load.eval()(ids).logits, rtol=0, atol=0)


def test_greedy_mtp_speculation_is_plain_greedy_and_drafts_what_the_head_predicts(tmp_path, monkeypatch):
    """speculative="mtp": greedy output equal to plain decoding's (one row, a ragged batch); every first draft is
    the reference head's argmax at its pair (the hidden state at the last consumed position, the token fed)."""
    hf, mtp, folder = _with_mtp(tmp_path)
    model, _ = from_pretrained(folder, dtype=torch.float64)
    prompt = _ids(9, seed=2)[0].tolist()
    plain, rounds = speculate_recording(model, monkeypatch, prompt, 14)
    seq = torch.tensor([prompt + plain])
    with torch.no_grad():
        ref, _ = mtp(hf.model(seq).last_hidden_state[:, :-1], seq[:, 1:])    # ref[:, i]: the token at i + 2
    assert all(drafts[0] == ref[0, n - 1].argmax().item() for n, _, drafts in rounds)
    assert_batch_speculation_is_plain(model, prompt, 8)


def test_a_wrong_or_partial_mtp_layer_is_named_and_the_model_loads_without_it(tmp_path):
    """An MTP tensor of the wrong shape, or one missing: the head is not loaded, the warning names the checkpoint's
    tensor; the language model loads whole. A second MTP layer is named as left out, the first loads."""
    import shutil

    hf, _, base = _with_mtp(tmp_path, torch.float32)
    ids = _ids(12)
    with torch.no_grad():
        want = hf(ids).logits

    def edited(j, edit):
        folder = shutil.copytree(base, tmp_path / f"case{j}")
        w = load_file(str(folder / "model.safetensors"))
        edit(w)
        save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    cases = [(lambda w: w.update({f"{MTP}eh_proj.weight": torch.zeros(32, 48)}),
              rf"MTP weight model\.layers\.{N}\.eh_proj\.weight has shape \(32, 48\), the config implies \(32, 64\)"),
             (lambda w: w.update({f"{MTP}attention.kv_b_proj.weight": torch.zeros(60, 16)}),
              rf"MTP weight model\.layers\.{N}\.attention\.kv_b_proj\.weight has shape \(60, 16\)"),
             (lambda w: w.update({f"{MTP}mlp.experts.3.up_proj.weight": torch.zeros(16, 30)}),
              rf"MTP weight model\.layers\.{N}\.mlp\.experts\.3\.up_proj\.weight has shape \(16, 30\)"),
             (lambda w: w.pop(f"{MTP}enorm.weight"),
              rf"missing from the checkpoint: model\.layers\.{N}\.enorm\.weight")]
    for j, (edit, message) in enumerate(cases):
        with pytest.warns(UserWarning, match=rf"not loaded: the multi-token-prediction head \(model\.layers\.{N}\.\*, "
                                             rf"\d+ tensors\).*{message}"):
            ours, _ = from_pretrained(edited(j, edit))
        assert getattr(ours, "mtp", None) is None
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4 * want.abs().max().item())
    folder = edited("two", lambda w: w.update({k.replace(MTP, f"model.layers.{N + 1}."): v.clone()
                                               for k, v in list(w.items()) if k.startswith(MTP)}))
    with pytest.warns(UserWarning, match=rf"multi-token-prediction layers model\.layers\.{N + 1}\* on"):
        ours, _ = from_pretrained(folder)
    assert ours.mtp is not None
