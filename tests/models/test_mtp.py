"""The checkpoints' multi-token-prediction heads (``models.mtp``) and drafting with them
(``generate(..., speculative="mtp")``): a tiny Qwen3-Next folder given random ``mtp.*`` tensors under the
published names; the reference is the layout written out in float64 around transformers' own decoder layer
holding the same weights (transformers has no MTP forward)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it)

from safetensors.torch import load_file  # noqa: E402

from subquad.models import from_pretrained  # noqa: E402
from tests.models import test_hf_delta, test_hf_qwen3_5  # noqa: E402
from tests.models.mtp_harness import (assert_batch_speculation_is_plain, assert_head_equals, causal, first,  # noqa: E402
                                      graft, random_head, reference, speculate_recording)

pytestmark = pytest.mark.usefixtures("unpaced")     # counts verifications: no pacing by wall time

MTP_LAYER = 1          # the tiny model's attention layer with experts: the MTP layer copies its shape


def _with_mtp(tmp_path, kind="qwen3_next"):
    """(transformers' model, a reference ``mtp(h, tokens)`` -> (logits, u), the folder) of a float64 Qwen3-Next
    (or Qwen3.5) with an MTP head: a perturbed copy of attention layer 1 (MoE) and random fc and zero-centred
    norms."""
    if kind == "qwen3_next":
        hf, folder = test_hf_delta._hf(tmp_path, kind, torch.float64)
        lm, RMS = hf.model, transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm
        src, d, eps = f"model.layers.{MTP_LAYER}.", hf.config.hidden_size, hf.config.rms_norm_eps
        (layer,) = graft(hf, tmp_path, folder, [(lambda t: t.model.layers[MTP_LAYER], src, "mtp.layers.0.")])
    else:
        hf, folder = test_hf_qwen3_5._hf(tmp_path, kind, torch.float64)
        lm, RMS = hf.model.language_model, transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm
        c = hf.config.text_config
        src, d, eps = f"model.language_model.layers.{MTP_LAYER}.", c.hidden_size, c.rms_norm_eps
        (layer,) = graft(hf, tmp_path, folder,
                         [(lambda t: t.model.language_model.layers[MTP_LAYER], src, "mtp.layers.0.")])
    names = {"embed": "mtp.pre_fc_norm_embedding.weight", "hidden": "mtp.pre_fc_norm_hidden.weight",
             "final": "mtp.norm.weight"}
    norms, fc = random_head(folder, RMS, d, eps, names, "mtp.fc.weight", torch.float64, centre=0.0)

    def run(z, T):
        pos = torch.arange(T)[None]
        return first(layer(z, position_embeddings=lm.rotary_emb(z, pos), attention_mask=causal(T, z.dtype),
                           position_ids=pos))

    hf.lm = lm
    return hf, reference(lm.embed_tokens, hf.lm_head, norms, fc, run), folder


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_the_mtp_head_equals_the_layout_written_out(tmp_path, kind):
    """Logits of every pair, all at once and in two pieces from the head's state, within 1e-6 of the reference;
    a Qwen3-Next folder saved and loaded again keeps the head (the multimodal Qwen3.5 is not written)."""
    hf, mtp, folder = _with_mtp(tmp_path, kind)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.mtp is not None and ours.mtp.block.mlp.__class__.__name__ == "MoE"
    ids = test_hf_delta._ids(21)
    with torch.no_grad():
        mine, got = assert_head_equals(ours, hf.lm(ids).last_hidden_state, ids, mtp)
        if kind != "qwen3_next":
            return
        ours.save_pretrained(tmp_path / "again")
        back, _ = from_pretrained(tmp_path / "again", dtype=torch.float64)
        torch.testing.assert_close(back.mtp(back, mine[:, :-1], ids[:, 1:])[0], got, rtol=0, atol=0)
    assert set(load_file(str(tmp_path / "again" / "model.safetensors"))) == set(
        load_file(str(folder / "model.safetensors")))


def test_greedy_mtp_speculation_is_plain_greedy_and_drafts_what_the_head_predicts(tmp_path, monkeypatch):
    """speculative="mtp": greedy output equal to plain decoding's (one row, a ragged batch); every first draft is
    the reference head's argmax at the pair (h at the last consumed position, the token to feed), over the
    final sequence, and the first round's second draft is its argmax one pair further, on its own output."""
    hf, mtp, folder = _with_mtp(tmp_path)
    model, _ = from_pretrained(folder, dtype=torch.float64)
    prompt = test_hf_delta._ids(9)[0].tolist()
    plain, rounds = speculate_recording(model, monkeypatch, prompt, 16)
    seq = torch.tensor([prompt + plain])
    with torch.no_grad():
        h = hf.model(seq).last_hidden_state
        ref, u = mtp(h[:, :-1], seq[:, 1:])                     # ref[:, i]: the token at i + 2, from pair i
    full = prompt + plain
    for n, feed, drafts in rounds:                               # feed: the token at position n (not yet consumed)
        assert feed == full[n]
        assert drafts[0] == ref[0, n - 1].argmax().item()
    n, feed, drafts = rounds[0]
    assert n == len(prompt)
    with torch.no_grad():
        chain, _ = mtp(torch.cat([h[:, :n], u[:, n - 1:n]], 1), torch.tensor([full[1:n + 1] + [drafts[0]]]))
    assert drafts[1] == chain[0, -1].argmax().item()
    assert_batch_speculation_is_plain(model, prompt, 10)


def test_mtp_needs_the_head(tmp_path):
    _, folder = test_hf_delta._hf(tmp_path, "qwen3_next")
    model, _ = from_pretrained(folder)
    assert getattr(model, "mtp", None) is None
    with pytest.raises(ValueError, match="multi-token-prediction head"):
        model.generate([1, 2, 3], 4, speculative="mtp")
