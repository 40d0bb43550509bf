"""What the MTP-head tests of every checkpoint type share (test_mtp.py: Qwen3-Next, Qwen3.5-MoE; test_mtp_bailing.py:
Ling; test_hf_nemotron_h.py: Nemotron 3): the head's weights made from perturbed copies of the tiny model's own
layers, random norms and a random fc under the checkpoint's names, the reference forward written out around
transformers' own layers, and the checks of subquad's head against it.

The reference (vLLM's and SGLang's MTP modules, DeepSeek-V3's layout), h (B, T, d) the final-normed hidden
states, tokens (B, T) the token after each:

    z = fc([norm_embed(embed(tokens)), norm_hidden(h)])     (B, T, 2d) -> (B, T, d)
    z = layers(z)                                            causal, positions 0 .. T-1
    u = norm_final(z);  logits = lm_head(u)                  the token two after each h
"""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file, save_file

from subquad.models.speculative import MTPDrafter


def graft(hf, tmp_path, folder, layers: list, buffers: bool = False) -> list:
    """Copy transformers' model ``hf``, perturb the copy's layers ``layers`` names - (pick: copy -> module, its
    checkpoint prefix, the MTP layer's prefix) - and write them into ``folder``'s weights under the MTP prefixes.
    Returns the perturbed modules, in order (the reference runs them)."""
    torch.manual_seed(5)
    twin = copy.deepcopy(hf)
    modules = [pick(twin) for pick, _, _ in layers]
    with torch.no_grad():
        for m in modules:
            for p in [*m.parameters(), *(m.buffers() if buffers else ())]:
                p.add_(0.05 * torch.randn_like(p))
    twin.save_pretrained(tmp_path / "twin")                 # the layers' tensors under the checkpoint's names
    theirs = load_file(str(tmp_path / "twin" / "model.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    for _, src, dst in layers:
        tensors.update({dst + k[len(src):]: v for k, v in theirs.items() if k.startswith(src)})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return modules


def random_head(folder, RMS, d: int, eps: float, norms: dict, fc: str, dtype, centre: float):
    """Random norms (``norms``: role -> checkpoint name; roles "embed", "hidden", "final") of weight centre +
    0.3 N(0, 1) (centre 0 for zero-centred norms) and a random fc (2d -> d) written into ``folder``'s weights.
    Returns ({role: module}, fc module)."""
    modules = {role: RMS(d, eps).to(dtype) for role in norms}
    lin = torch.nn.Linear(2 * d, d, bias=False).to(dtype)
    tensors = load_file(str(folder / "model.safetensors"))
    with torch.no_grad():
        for role, m in modules.items():
            m.weight.copy_(centre + 0.3 * torch.randn(d))
            tensors[norms[role]] = m.weight.clone()
        tensors[fc] = lin.weight.detach().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return modules, lin


def reference(embed, head, norms: dict, fc, run):
    """The written-out head: ``run(z, T)`` runs the layers (transformers' own, holding the MTP weights)."""

    @torch.no_grad()
    def mtp(h, tokens):
        """h (B, T, d) after the final norm, tokens (B, T) the token after each -> (logits, u)."""
        z = fc(torch.cat([norms["embed"](embed(tokens)), norms["hidden"](h)], -1))
        u = norms["final"](run(z, h.shape[1]))
        return head(u), u

    return mtp


def causal(T: int, dtype) -> torch.Tensor:
    return torch.full((T, T), float("-inf"), dtype=dtype).triu(1)[None, None]


def first(out):
    """A transformers layer's hidden states (some return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def assert_head_equals(ours, h, ids, mtp):
    """subquad's head on its own hidden states: those within 1e-6 of transformers' ``h`` (the parity tests'
    bound), every pair's logits within 1e-6 of the reference's, all at once and in two pieces from the head's
    state. Returns subquad's final-normed hidden states and logits."""
    ref, _ = mtp(h[:, :-1], ids[:, 1:])
    mine = ours.norm(ours._hidden(ids)[0])
    torch.testing.assert_close(mine, h, rtol=0, atol=1e-6 * h.abs().max().item())
    got, _, _ = ours.mtp(ours, mine[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    a, _, s = ours.mtp(ours, mine[:, :7], ids[:, 1:8])
    b, _, _ = ours.mtp(ours, mine[:, 7:-1], ids[:, 8:], s)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    return mine, got


def speculate_recording(model, monkeypatch, prompt: list, n: int, k: int = 3):
    """Greedy decoding of ``n`` tokens plain and with speculative="mtp" (``k`` drafts): asserts they are equal and
    counted; returns (the plain tokens, [(tokens consumed, the token fed, the drafts)] of every proposal)."""
    rounds, emitted, propose, append = [], [], MTPDrafter.propose, MTPDrafter.append

    def recording(self, feed, active, k):
        drafts = propose(self, feed, active, k)
        rounds.append((len(prompt) + len(emitted) - 1, feed[0], drafts[0]))
        return drafts

    def counting(self, i, token):
        emitted.append(token)
        append(self, i, token)

    with monkeypatch.context() as m:
        m.setattr(MTPDrafter, "propose", recording)
        m.setattr(MTPDrafter, "append", counting)
        plain, _ = model.generate(prompt, n, temperature=0)
        spec, _ = model.generate(prompt, n, temperature=0, speculative="mtp", draft_tokens=k)
    assert spec == plain and model.speculation_stats.verifications == len(rounds) > 0
    return plain, rounds


def assert_batch_speculation_is_plain(model, prompt: list, n: int):
    """A ragged batch of three rows: greedy with MTP drafts (2) equals plain greedy."""
    batch = [prompt, prompt[3:], prompt[:4]]
    want = model.generate(batch, n, temperature=0)[0]
    assert model.generate(batch, n, temperature=0, speculative="mtp", draft_tokens=2)[0] == want
