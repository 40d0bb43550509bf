"""Speculative decoding (``models.speculative``): the state after an accepted prefix equals prefilling it, in every
block structure; greedy output equals plain decoding's for every mixer, one row and a ragged batch, and with the
sampling options (penalties, logit bias, stop ids, ignore_eos); sampled output is distributed as plain sampling's
(chi-square), with and without them; prompt lookup drafts what it should."""

import math

import pytest
import torch

from subquad.layers.registry import causal_mixers
from subquad.layers.rollback import same_state
from subquad.models import LanguageModel, ModelConfig
from subquad.models.sampling import Sampler, SamplingOptions, probabilities
from subquad.models.speculative import Pacer, PromptLookup, accept_drafts, keeps_states, ngram_draft
from subquad.ops import KVCache
from subquad.testing import check_mixer

OPTIONS = {"swa": {"window": 3}, "*": {"chunk_size": 4}}
PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]

pytestmark = pytest.mark.usefixtures("unpaced")     # counts verifications: no pacing by wall time


def tiny(pattern, n_layers=2, vocab=11, scale=1.0, options=None, **over):
    """A float64 model; ``scale`` multiplies its matrices (larger: peakier, more varied greedy output);
    ``options``: mixer options over ``OPTIONS``."""
    torch.manual_seed(0)
    names = set(pattern.replace("*", ",").split(",")) | set(over.get("parallel", {}).values())
    cfg = ModelConfig(vocab_size=vocab, d_model=16, n_layers=n_layers, n_heads=2, pattern=pattern, context_length=64,
                      mixer_options={k: v for k, v in {**OPTIONS, **(options or {})}.items() if k in names or k == "*"},
                      **over)
    model = LanguageModel(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


@pytest.mark.parametrize("window", [3, 7])
def test_a_sliding_window_rolls_back_whether_or_not_it_holds_the_verified_tokens(window):
    """window 3 < the 5 verified tokens: replayed; window 7: the kept tokens appended to the cache before, the
    window sliding past old ones (the battery checks every entry of the table at its defaults)."""
    assert check_mixer("swa", checks=["rollback"], options={"window": window}) == ["rollback"]


def test_kv_cache_rollback_reuses_the_buffers_and_refuses_what_a_window_let_go():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 9, 1, 4, generator=g, dtype=torch.float64)
    before = KVCache(k[:, :6], k[:, :6])
    after = before.fork().append(k[:, 6:], k[:, 6:])
    cut = after.rollback(2)
    assert (cut.seen, len(cut)) == (7, 7) and torch.equal(cut.k, k[:, :7])
    cut.append(k[:, :1], k[:, :1])                           # writes in place over the dropped token
    assert cut._k is after._k and torch.equal(before.k, k[:, :6])
    win = KVCache(k[:, :4], k[:, :4], window=4).fork().append(k[:, 4:6], k[:, 4:6])
    with pytest.raises(ValueError, match="let go"):
        win.rollback(1)
    with pytest.raises(ValueError, match="drop must be"):
        before.rollback(7)


def test_kv_cache_rollback_per_row_right_aligns_the_rows_it_drops_more_from():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 9, 1, 4, generator=g, dtype=torch.float64)
    after = KVCache(k[:, :6], k[:, :6] + 1).fork().append(k[:, 6:], k[:, 6:] + 1)
    cut = after.rollback_rows([1, 3, 1])
    assert cut.seen == 8 and len(cut) == 8 and cut.pad.tolist() == [0, 2, 0] and cut.row_seen.tolist() == [8, 6, 8]
    for b, (row, n) in enumerate(zip(cut.unstack(), (8, 6, 8))):
        assert row.seen == n and torch.equal(row.k, k[b:b + 1, :n]) and torch.equal(row.v, k[b:b + 1, :n] + 1)
    assert not cut.k[1, :2].any() and not cut.v[1, :2].any()               # the new padding: zeros
    # fresh buffers as large as the cache's (a server's reserved room stays), the cache itself as it was
    assert cut._k.shape[1] == after._k.shape[1] and cut._k.data_ptr() != after._k.data_ptr()
    assert torch.equal(after.k, k) and torch.equal(after.v, k + 1) and len(after) == 9
    cut.append(k[:, :2], k[:, :2])                                         # appends in place, in that room
    assert cut._k.shape[1] == after._k.shape[1] and torch.equal(cut.k[1, 2:], torch.cat([k[1, :6], k[1, :2]]))
    assert after.rollback_rows([2, 2, 2]).pad is None                      # the same count: rollback's O(1) fork
    with pytest.raises(ValueError, match="drops must be 3 ints"):
        after.rollback_rows([1, 2])
    win = KVCache(k[:, :6], k[:, :6], window=8).fork().append(k[:, 6:7], k[:, 6:7])
    with pytest.raises(ValueError, match="windowed cache"):
        win.rollback_rows([0, 1, 0])


STRUCTURES = {                      # the block structures of the checkpoint types (models.hf), tiny
    "prenorm hybrid (jamba, bamba, nemotron_h, granitemoehybrid, qwen3_next, kimi_linear, lfm2, ...)":
        dict(pattern="mamba2,softmax,swa,gated_conv", n_layers=4),
    "post-norm (olmo_hybrid)": dict(pattern="gated_deltanet,softmax", post_norm=["softmax"]),
    "scaled residual (minimax)": dict(pattern="lightning,softmax", scaled_residual={"lightning": [1.5, 0.5]}),
    "parallel (falcon_h1)": dict(pattern="mamba2", parallel={"mamba2": "softmax"}),
    "shared blocks (zamba2)": dict(pattern="mamba2*3", n_layers=3, shared={
        "layers": [0, 2], "blocks": 1, "adapter_rank": 4, "attention_adapter": True, "act": "gelu"}),
    "rwkv7 (channel mix state, value residual)": dict(pattern="rwkv7", mlp_kind="rwkv7", norm="layer",
                                                     embed_norm=True),
    "moe and positions (mla, rglru, learned)": dict(pattern="mla,rglru", pos_emb="learned",
                                                   moe={"experts": 4, "top_k": 2, "every": 2, "offset": 1}),
    "mamba (mamba, falcon_mamba), retention": dict(pattern="mamba,retention"),
    "sandwich norms, gated heads, Mamba heads, Ling's KDA (lfm3, zamba, bailing_hybrid)": dict(
        pattern="mamba,swa,kda,mla", n_layers=4, sandwich_norm=True, options={
            "mamba": {"heads": 2}, "swa": {"window": 4, "head_gate": True}, "mla": {"head_gate": True},
            "kda": {"full_gates": True, "gate_bound": -5.0}}),
    "hyper-connections, n-gram embeddings, QSA (qwen4_exp)": dict(
        pattern="gated_deltanet,qsa", hyper={"streams": 2, "rank": 4, "ple": {
            "layers": [0], "dim": 8, "eos": 1, "ngram": 3, "heads_per_ngram": 2, "vocab_base": 20,
            "vocab_multiple": 4}},
        options={"qsa": {"index_heads": 2, "index_head_dim": 8, "index_budget": 4, "index_block": 2}}),
}


def assert_rollback_is_a_prefill(model, label, keeps=None, k=5, how="replay"):
    """verify k tokens from a ragged batch's state, accept j (each j of ``keeps``, default 0..k): the state, and the
    logits of the next step from it, equal a prefill of exactly those tokens (float64); and a different j per row,
    against one forward over each row's whole sequence. ``how="states"`` (kept per token) where the model keeps
    its states per token at 2 rows, else at one row (KV caches)."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 3)]
    _, start = model.prefill(torch.tensor([prompts[0] + prompts[1]]), cu_seqlens=torch.tensor([0, 5, 8]),
                             logits="last")
    drafts = torch.randint(0, V, (2, k), generator=g)
    nxt = torch.randint(0, V, (2,), generator=g)
    if how != "replay" and not keeps_states(model, drafts):
        prompts, drafts, nxt = prompts[:1], drafts[:1], nxt[:1]
        _, start = model.prefill(torch.tensor(prompts), logits="last")
    for keep in range(k + 1) if keeps is None else keeps:
        logits, ver = model.verify(drafts, start, how)
        assert type(ver).__name__ == ("Verification" if how == "replay" else "KeptStates")
        got = ver.accept(keep)
        want_logits, want = model.prefill(drafts[:, :keep], start) if keep else (None, start)
        if keep:
            torch.testing.assert_close(logits[:, :keep], want_logits, rtol=0, atol=1e-9)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert same_state(a, b, atol=1e-9) is None, f"{label}, layer {i}, keep {keep}: {same_state(a, b)}"
        assert torch.equal(torch.as_tensor(got.pos), torch.as_tensor(want.pos))
        torch.testing.assert_close(model.step(nxt, got)[0], model.step(nxt, want)[0], rtol=0, atol=1e-9)
    if len(prompts) == 1:
        return
    rows = [min(2, k - 1), min(4, k)]                 # a prefix per row: the rows' states become ragged
    got = model.step(nxt, model.verify(drafts, start, how)[1].accept(rows))[0]
    for b, n in enumerate(rows):
        ids = torch.tensor([prompts[b] + drafts[b, :n].tolist() + [int(nxt[b])]])
        torch.testing.assert_close(got[b], model(ids)[0, -1], rtol=0, atol=1e-9, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("how", ["replay", "states"])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_accepting_j_verified_tokens_equals_prefilling_them_in_every_block_structure(structure, how):
    model = tiny(**STRUCTURES[structure])
    with torch.no_grad():
        if how == "states" and not keeps_states(model, torch.zeros(1, 5, dtype=torch.long)):
            with pytest.raises(ValueError, match="kept per token"):                     # retention, rglru: replayed
                model.verify(torch.zeros(1, 5, dtype=torch.long), model.prefill(torch.zeros(1, 2).long())[1], how)
            return
        assert_rollback_is_a_prefill(model, structure, how=how)


def test_every_checkpoint_type_rolls_back(monkeypatch, tmp_path):
    """The model each Hugging Face checkpoint type of the parity table loads (``models.hf``: its config translated,
    random float64 weights - the translation is what sets the block structure), rolled back to 3 of 5 tokens and
    to 2 and 4 in two rows. The table's tiny transformers configs are read without building transformers' models."""
    pytest.importorskip("transformers")
    import sys

    from subquad.models.hf.registry import MAPPINGS
    from tests.models import hf_harness, test_hf_parity

    class Config(Exception):
        pass

    def config_only(tmp_path, name, Config_, Model, cfg, *args, **kwargs):
        raise Config(Config_(**cfg).to_dict())

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("tests.models.") and getattr(mod, "tiny", None) is hf_harness.tiny:
            monkeypatch.setattr(mod, "tiny", config_only)
    kept = 0
    for row in test_hf_parity.ROWS:
        try:
            _, folder = row.build(tmp_path / row.id, torch.float64)     # a type with its own builder: the folder
            from subquad.models import from_pretrained

            model = from_pretrained(folder)[0].double()
        except Config as e:
            c = e.args[0]
            torch.manual_seed(0)
            model = LanguageModel(MAPPINGS[c["model_type"]].config(c)).double().eval()
        with torch.no_grad():
            assert_rollback_is_a_prefill(model, row.id, keeps=(3,))
            if keeps_states(model, torch.zeros(1, 5, dtype=torch.long)):
                assert_rollback_is_a_prefill(model, row.id, keeps=(3,), how="states")
            kept += keeps_states(model, torch.zeros(1, 5, dtype=torch.long))
    assert kept >= len(test_hf_parity.ROWS) - 4, f"only {kept} types keep their states per token"


@pytest.mark.parametrize("pattern", sorted(causal_mixers()))
def test_greedy_speculation_is_plain_greedy_decoding_for_every_mixer(pattern):
    """One row (its output and final state) and a batch of prompts of three lengths, in a hybrid with softmax
    attention; in both some drafts are accepted and some rolled back (7-11 of 10-19 accepted, every mixer)."""
    model = tiny(f"{pattern},softmax", scale=6.0)
    plain, s0 = model.generate(PROMPT, 14, temperature=0)
    spec, s1 = model.generate(PROMPT, 14, temperature=0, speculative="ngram", draft_tokens=3)
    assert spec == plain
    st = model.speculation_stats
    assert st.verifications > 0 and 0 < st.accepted < st.drafted, st
    assert s1.pos == s0.pos and all(same_state(a, b, atol=1e-9) is None for a, b in zip(s1, s0, strict=True))
    batch = [PROMPT, PROMPT[2:9], [4, 4, 6]]
    plain = model.generate(batch, 9, temperature=0, stop_ids=[7])[0]
    assert model.generate(batch, 9, temperature=0, stop_ids=[7], speculative="ngram")[0] == plain
    st = model.speculation_stats
    assert 0 < st.accepted < st.drafted, st


PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={5: 1.5, 9: -2.0})


def test_the_processing_of_the_drafts_is_the_plain_processing_after_each_of_them():
    """``Sampler.process_drafts``: position i bit for bit ``process`` after recording drafts[:, :i]; it records
    nothing (a second verification after recording the same tokens agrees again)."""
    g = torch.Generator().manual_seed(2)
    B, k, V = 3, 4, 11
    prompts = [[1, 2, 2], [5], [0, 9, 10, 4]]
    ahead, plain = Sampler(SamplingOptions(**PENALTIES), prompts), Sampler(SamplingOptions(**PENALTIES), prompts)
    for _ in range(2):
        logits = torch.randn(B, k + 1, V, generator=g, dtype=torch.float64) * 3
        drafts = torch.randint(0, 4, (B, k), generator=g)                   # small ids: drafts repeat
        got = ahead.process_drafts(logits, drafts)
        for i in range(k + 1):
            assert torch.equal(got[:, i], plain.process(logits[:, i])), i
            if i < k:
                plain.record(drafts[:, i])
        ahead.record(drafts.flatten(), torch.arange(B).repeat_interleave(k))


def test_greedy_speculation_with_the_sampling_options_is_plain_greedy_decoding(monkeypatch):
    """Penalties and logit bias (each position's history includes the drafts before it), every token as a
    stop id - one of them inside an accepted run, which ends the row there - and ignore_eos; one row (its
    state too) and a ragged batch."""
    import subquad.models.generate as gen

    runs = []

    def spy(*args):
        tokens, accepted = accept_drafts(*args)
        runs.append([t[:a] for t, a in zip(tokens.tolist(), accepted.tolist(), strict=True)])
        return tokens, accepted

    monkeypatch.setattr(gen, "accept_drafts", spy)
    model = tiny("gla,softmax")
    plain, s0 = model.generate(PROMPT, 30, temperature=0, **PENALTIES)
    spec, s1 = model.generate(PROMPT, 30, temperature=0, speculative="ngram", **PENALTIES)
    assert spec == plain and plain != model.generate(PROMPT, 30, temperature=0)[0]
    assert model.speculation_stats.accepted > 0
    assert s1.pos == s0.pos and all(same_state(a, b, atol=1e-9) is None for a, b in zip(s1, s0, strict=True))
    inside = set()
    for stop in range(11):
        runs.clear()
        want = model.generate(PROMPT, 30, temperature=0, stop_ids=[stop], **PENALTIES)[0]
        got = model.generate(PROMPT, 30, temperature=0, stop_ids=[stop], speculative="ngram", **PENALTIES)[0]
        assert got == want == plain[:plain.index(stop) + 1 if stop in plain else 30], stop
        inside |= {stop for run in runs for row in run if stop in row}
    assert inside                                                  # a stop id among accepted drafts
    model.config.eos_token_ids = [plain[9]]
    for ignore_eos in (False, True):
        want = model.generate(PROMPT, 30, temperature=0, ignore_eos=ignore_eos, **PENALTIES)[0]
        got = model.generate(PROMPT, 30, temperature=0, ignore_eos=ignore_eos, speculative="ngram", **PENALTIES)[0]
        assert got == want == (plain if ignore_eos else plain[:plain.index(plain[9]) + 1])
    batch = [PROMPT, PROMPT[2:9], [4, 4, 6]]
    want = model.generate(batch, 12, temperature=0, stop_ids=[7], **PENALTIES)[0]
    assert model.generate(batch, 12, temperature=0, stop_ids=[7], speculative="ngram", **PENALTIES)[0] == want


def test_speculation_counts_its_steps_and_pauses_when_drafts_fail(monkeypatch):
    """A batch's drafting pauses 1, 2, 4, ... steps after verifications that keep nothing; one row drafting by
    prompt lookup leaves that to the pacer, which judges each match length on its own (``unpaced`` here)."""
    from subquad.models import generate as generate_mod

    model = tiny("mamba2,softmax", scale=1.0)                    # soon repeats one token: drafts accepted
    model.generate(PROMPT, 30, temperature=0, speculative="ngram", draft_tokens=4)
    st = model.speculation_stats
    assert st.emitted == 29 and st.acceptance > 0.8 and st.tokens_per_step > 2.5
    model = tiny("mamba2,softmax", scale=20.0)                   # varied output: drafts fail
    model.generate(PROMPT, 30, temperature=0, speculative="ngram", draft_tokens=4)
    st = model.speculation_stats
    assert st.acceptance < 0.2 and st.verifications > 0.8 * st.steps     # no pause: every step with a draft
    batch = [PROMPT, PROMPT[:-1]]
    model.generate(batch, 30, temperature=0, speculative="ngram", draft_tokens=4)
    st = model.speculation_stats
    assert st.acceptance < 0.2 and st.verifications < st.steps / 2       # drafting pauses
    monkeypatch.setattr(generate_mod, "MAX_PAUSE", 0)
    model.generate(batch, 30, temperature=0, speculative="ngram", draft_tokens=4)
    st = model.speculation_stats
    assert st.verifications > 0.8 * st.steps


def test_one_row_of_prompt_lookup_asks_the_pacer_by_its_match_length(monkeypatch):
    """At one row prompt lookup drafts first and the pacer is asked under the n its draft matched: the longest
    n <= 3 whose tail of the row's tokens occurred before, found again here from the tokens."""
    from subquad.models.speculative import NgramDrafter

    asked, found = [], []
    monkeypatch.setattr(Pacer, "want", lambda self, key=None: asked.append(key) or True)
    real = NgramDrafter.key

    def key(self, i):
        hist = self.hist[i].tokens
        found.append(max([0] + [n for n in (1, 2, 3) if any(hist[s:s + n] == hist[-n:]
                                                             for s in range(len(hist) - n))]))
        return real(self, i)
    monkeypatch.setattr(NgramDrafter, "key", key)
    model = tiny("mamba2,softmax", scale=8.0)
    prompt = [1, 2, 3, 4, 1, 2, 5, 4, 2, 3]
    out = model.generate(prompt, 20, temperature=0, speculative="ngram", draft_tokens=3)[0]
    assert out == model.generate(prompt, 20, temperature=0)[0]
    assert len(asked) >= 3 and asked == [n for n in found if n]      # asked whenever it drafted, by that n
    assert len(set(asked)) >= 2


@pytest.mark.parametrize("pos_emb", ["learned", "none"])
def test_rows_draft_up_to_their_own_end_and_learned_positions_never_pass_the_context(pos_emb):
    """Each row drafts up to its own room (rows that accept more finish sooner; the others go on verifying).
    Learned positions end at context_length: the longer prompt reaches it exactly, no verification may pass it,
    and a batch - whose finished rows are fed padding - that could walk past it decodes without speculation."""
    model = tiny("mamba2,softmax", scale=8.0, pos_emb=pos_emb)
    batch = [PROMPT, [5, 9, 2, 6, 5, 3, 5, 8]]                   # the first accepts more: it ends first
    n = model.config.context_length - len(PROMPT)
    plain = model.generate(batch, n, temperature=0)[0]
    assert model.generate(batch, n, temperature=0, speculative="ngram", draft_tokens=6)[0] == plain
    st = model.speculation_stats
    assert st.emitted == 2 * n - 2 and (st.verifications == 0) == (pos_emb == "learned")
    assert model.generate(PROMPT, n, temperature=0, speculative="ngram", draft_tokens=6)[0] == plain[0]
    assert model.speculation_stats.verifications > 0


def test_the_pacer_hears_what_the_slowest_row_emitted(monkeypatch):
    """A batch of generate ends with its slowest row (a row that finished first only pads the steps after it),
    so each verification reports to the pacer the tokens the row that moved least emitted, not the mean."""
    from subquad.models import speculative

    heard, kept = [], []
    measured, accept = Pacer.measured, speculative.Verification.accept

    def hearing(self, seconds, tokens_per_row=None, batch=1, key=None):
        if tokens_per_row is not None:
            heard.append(tokens_per_row)
        measured(self, seconds, tokens_per_row, batch, key)

    def keeping(self, keep):
        kept.append(keep)
        return accept(self, keep)
    monkeypatch.setattr(Pacer, "measured", hearing)
    monkeypatch.setattr(speculative.Verification, "accept", keeping)
    model = tiny("mamba2,softmax")
    model.generate([PROMPT, [5, 9, 2, 6, 5, 3, 5, 8]], 30, temperature=0, speculative="ngram", draft_tokens=4)
    assert kept[0] == [1, 5] and heard[0] == 1                  # rows kept 1 and 5: the pacer hears 1, not 3
    assert len(heard) == len(kept) == model.speculation_stats.verifications
    # then the least of the rows' moving averages (weight ALPHA on the newest), while both rows go on
    avg, emitted, a = [None, None], [1, 1], Pacer.ALPHA
    for keep, got in zip(kept, heard):
        emitted = [e + n for e, n in zip(emitted, keep)]
        if max(emitted) >= 30:
            break
        avg = [n if m is None else (1 - a) * m + a * n for m, n in zip(avg, keep)]
        assert got == pytest.approx(min(avg))
    assert any(min(k) < got for k, got in zip(kept[1:], heard[1:]))   # not one verification's least


def test_a_batch_drafts_no_more_than_its_rows_verify_at_a_steps_cost(monkeypatch):
    """On the CPU each of B rows drafts at most C_ROWS // B - 1 tokens (at least one): at 8 rows one, so the
    verification's 16 rows x tokens stay one C call per Mamba-2 block; outputs equal plain greedy decoding's."""
    from subquad.layers.linear import C_ROWS
    from subquad.models import generate as generate_mod
    from subquad.models.speculative import draft_budget

    model = tiny("mamba2,softmax", scale=6.0)
    assert [draft_budget(model, b, 4) for b in (1, 2, 3, 4, 5, 8, 16, 40)] == [4, 4, 4, 3, 2, 1, 1, 1]
    assert draft_budget(model, 8, 0) == 0 and C_ROWS == 16
    widths, real = [], generate_mod.verify
    monkeypatch.setattr(generate_mod, "verify",
                        lambda m, ids, *a, **k: widths.append(ids.shape) or real(m, ids, *a, **k))
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(8)]
    plain = model.generate(prompts, 24, temperature=0)[0]
    assert model.generate(prompts, 24, temperature=0, speculative="ngram", draft_tokens=4)[0] == plain
    assert widths and {w for w in widths} == {(8, 2)}
    widths.clear()
    assert model.generate(prompts[:3], 24, temperature=0, speculative="ngram", draft_tokens=6)[0] == plain[:3]
    assert widths and max(w[1] for w in widths) == 5            # 3 rows: 4 drafts (15 rows x tokens)


def _draft_for(model, pattern="gla", seed=1, noise=0.0):
    """A one-layer draft with the model's vocabulary: random (``noise`` 0), or ``model`` itself perturbed."""
    if noise:
        torch.manual_seed(seed)
        import copy

        draft = copy.deepcopy(model)
        with torch.no_grad():
            for p in draft.parameters():
                p.mul_(1 + noise * torch.randn_like(p))        # relative: the same model, blurred
        return draft
    draft = tiny(pattern, n_layers=len(pattern.split(",")), vocab=model.config.vocab_size, scale=6.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        draft.embed.weight.normal_()
    return draft


@pytest.mark.parametrize("target,draft", [("mamba2,softmax", "gla"), ("gated_deltanet", "swa,mamba")])
def test_greedy_speculation_with_a_draft_model_is_plain_greedy_decoding(target, draft):
    """A draft model's greedy drafts: one row, and a ragged batch whose rows accept different numbers of drafts
    (the draft's own state rolled back per row), with a stop id; the final state equals plain decoding's. Scale 10:
    at 6 the first target's greedy rows each repeat one token, and every draft was accepted (nothing rolled back)."""
    model = tiny(target, scale=10.0)
    for d in (_draft_for(model, draft), _draft_for(model, noise=0.1)):
        plain, s0 = model.generate(PROMPT, 14, temperature=0)
        spec, s1 = model.generate(PROMPT, 14, temperature=0, speculative=d, draft_tokens=3)
        assert spec == plain
        assert s1.pos == s0.pos and all(same_state(a, b, atol=1e-9) is None for a, b in zip(s1, s0, strict=True))
        batch = [PROMPT, PROMPT[2:9], [4, 4, 6]]
        plain = model.generate(batch, 11, temperature=0, stop_ids=[7])[0]
        assert model.generate(batch, 11, temperature=0, stop_ids=[7], speculative=d, draft_tokens=3)[0] == plain
        st = model.speculation_stats
        assert st.verifications > 0 and 0 < st.accepted < st.drafted, st


def test_the_model_drafting_for_itself_is_always_accepted():
    """The target as its own draft: every greedy draft is its argmax, so all are accepted (k + 1 tokens per
    verification); a perturbed copy is accepted less; a random draft least."""
    model = tiny("mamba2,softmax", scale=20.0)                  # varied greedy output
    acceptance = []
    for d in (model, _draft_for(model, noise=0.1), _draft_for(model, "gla")):
        out = model.generate(PROMPT, 21, temperature=0, speculative=d, draft_tokens=4)[0]
        assert out == model.generate(PROMPT, 21, temperature=0)[0]
        acceptance.append(model.speculation_stats.acceptance)
    st = model.generate(PROMPT, 21, temperature=0, speculative=model, draft_tokens=4) and model.speculation_stats
    assert st.acceptance == 1.0 and st.tokens_per_step == 5.0 and st.steps == 4
    assert acceptance[0] == 1.0 > acceptance[2] and acceptance[1] > acceptance[2]


@pytest.mark.parametrize("pattern", ["gla,softmax", "mamba"])
def test_a_draft_model_catches_up_on_the_plain_steps_in_one_prefill(pattern):
    """Plain steps of the target only queue their fed tokens for the draft model (it does not run while drafting
    waits); the next proposal prefills them: its state then equals the draft prefilled on every token, in a ragged
    batch too, and its drafts are its greedy continuation from there."""
    from subquad.models.speculative import ModelDrafter

    model = tiny("mamba2,softmax")
    draft = _draft_for(model, pattern)
    prompts = [PROMPT, [3, 1, 4, 1, 5]]
    d = ModelDrafter(draft, model, prompts)
    fed = [[2, 7], [6, 8], [9, 1]]                              # three plain steps of both rows
    for f in fed:
        d.settle(f, None, 1)
    assert len(d.pending) == 3
    got = d.propose([4, 4], [0, 1], 2)
    assert d.pending == []
    for i, p in enumerate(prompts):
        seq = p + [f[i] for f in fed] + [4]
        want, state = draft.prefill(torch.tensor([seq]), logits="last")
        first = int(want.argmax(-1))
        second = int(draft.step(torch.tensor([first]), state)[0].argmax(-1))
        assert got[i] == [first, second], i


def test_a_draft_model_must_share_the_vocabulary_and_device():
    model = tiny("mamba2", n_layers=1)
    for bad, match in ((tiny("gla", n_layers=1, vocab=12), "vocab_size"), ("medusa", "speculative"),
                       (object(), "draft model")):
        with pytest.raises(ValueError, match=match):
            model.generate(PROMPT, 3, speculative=bad)


def test_ngram_draft_takes_the_longest_suffix_match_with_a_full_continuation():
    assert ngram_draft([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3], 2) == [9, 2]          # "1 2 3" beats "2 3" (-> 7 8)
    assert ngram_draft([5, 6, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]
    assert ngram_draft([4] * 6, 2) == [4, 4]                 # the run's latest match has one token after it
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([1], 4) == []


def test_the_indexed_prompt_lookup_drafts_as_the_plain_search():
    g = torch.Generator().manual_seed(5)
    for V in (2, 3, 6):
        tokens = torch.randint(0, V, (120,), generator=g).tolist()
        look = PromptLookup(tokens[:1], index_from=0)
        for L in range(2, len(tokens) + 1):
            look.append(tokens[L - 1])
            for k in (1, 4):
                if (L + k) % 3:                       # some lengths skipped: the index catches up
                    assert look.draft(k) == ngram_draft(tokens[:L], k), (V, L, k)


def _chi2_p(counts, probs):
    """The chi-square test's p-value of ``counts`` against ``probs``: cells expecting under 5 pooled, cells of
    probability 0 left out (the callers check they stay empty)."""
    from scipy.stats import chisquare

    probs = probs.double()
    expected = probs / probs.sum() * counts.sum()
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = [counts[big].double()], [expected[big]]
    if rare.any():
        obs.append(counts[rare].sum().double().view(1))
        exp.append(expected[rare].sum().view(1))
    obs, exp = torch.cat(obs), torch.cat(exp)
    return chisquare(obs.numpy(), exp.numpy() / exp.sum().item() * obs.sum().item()).pvalue


def test_the_acceptance_rule_draws_each_position_from_the_target_distribution():
    """Fixed logits for k + 1 positions, one draft per position, 40,000 rows: the first emitted token ~ p_0 and,
    given the drafts before it were accepted, the token at position i ~ p_i (the drafts: likely, unlikely and
    impossible under top_k)."""
    g = torch.Generator().manual_seed(3)
    V, k, n = 6, 3, 40_000
    logits = torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 1.5
    for top_k in (None, 4):
        drafts = torch.stack([logits[0].argmax(), logits[1].argmin(), logits[2].argmax()])
        p = probabilities(logits, 1.0, top_k)
        tokens, accepted = accept_drafts(logits.expand(n, -1, -1), drafts.expand(n, -1), p.expand(n, -1, -1), g)
        p = p / p.sum(-1, keepdim=True)
        for i in range(k + 1):
            reached = accepted >= i                      # every draft before position i accepted
            emitted = tokens[reached, i]                 # its draft if accepted, else the draw at the rejection
            counts = torch.bincount(emitted, minlength=V)
            if reached.sum() > 1000:
                assert _chi2_p(counts, p[i]) > 0.01, (top_k, i, counts, p[i])
            assert counts[p[i] == 0].sum() == 0


@pytest.mark.parametrize("options", [{}, dict(PENALTIES, logit_bias={2: 1.0}, min_p=0.05)])
def test_sampled_speculation_is_distributed_as_plain_sampling(options, monkeypatch):
    """20,000 rows of one prompt, four tokens each, through generate with speculation (rows accept
    different numbers of drafts): both joint distributions match the model's own, computed by enumerating
    every continuation - each token's distribution processed with the tokens before it (``Sampler.process``,
    tested against the rules by hand in test_sampling.py). Every row drafts the default 4 tokens (a batch this
    large would draft one: ``draft_budget``, a speed policy), so every position's rule is exercised."""
    from subquad.models import speculative

    monkeypatch.setattr(speculative, "draft_budget", lambda model, batch, k: k)     # read by drafting_plan
    model = tiny("linear", n_layers=1, vocab=4, scale=4.0)
    prompt, V, n, m = [1, 2, 1, 2, 1], 4, 20_000, 4
    seqs = torch.cartesian_prod(*[torch.arange(V)] * m)                              # (V^m, m)
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1))
    L, o = len(prompt), SamplingOptions(**options)
    sampler, logp = Sampler(o, [prompt] * len(seqs)), 0
    for i in range(m):
        p = probabilities(sampler.process(logits[:, L - 1 + i]), 1.0, o.top_k, o.top_p, o.min_p)
        logp = logp + (p / p.sum(-1, keepdim=True)).gather(-1, seqs[:, i:i + 1]).squeeze(-1).log()
        sampler.record(seqs[:, i])
    p = logp.exp()
    for speculative in ("ngram", tiny("gla", n_layers=1, vocab=4, scale=4.0)):     # plain sampling: test_sampling
        out, _ = model.generate([prompt] * n, m, temperature=1.0, seed=4, speculative=speculative, **options)
        codes = torch.tensor(out) @ (V ** torch.arange(m - 1, -1, -1))
        counts = torch.bincount(codes, minlength=V ** m)
        assert _chi2_p(counts, p) > 0.01, speculative
        assert counts[p == 0].sum() == 0
    st = model.speculation_stats
    assert st.verifications > 0 and 0 < st.accepted < st.drafted


def test_the_cli_flag_decodes_speculatively_with_the_same_output(tmp_path, capsys, monkeypatch):
    """``subquad generate --speculative ngram --draft-tokens K``: the greedy text without the flag (with sampling
    flags too), and the statistics on stderr (a tiny model and a one-character-per-token tokenizer in place of
    a run)."""
    from types import SimpleNamespace

    import subquad.cli.generate as cli
    from subquad.cli import main

    model = tiny("mamba2,softmax", scale=6.0)
    abc = "abcdefghijk"
    tok = SimpleNamespace(encode=lambda s: SimpleNamespace(ids=[abc.index(c) for c in s]),
                          decode=lambda ids: "".join(abc[i] for i in ids))
    draft = _draft_for(model, noise=0.1)
    (tmp_path / "draft" / "ckpt").mkdir(parents=True)     # a run folder: its config.json beside ckpt/
    (tmp_path / "draft" / "config.json").write_text("{}")
    (tmp_path / "hf").mkdir()                                # a model folder: config.json alone
    (tmp_path / "hf" / "config.json").write_text("{}")
    loaded = []

    def load_model(args, need_tokenizer=None):
        loaded.append(args.run or "model " + args.model)
        return (draft if (args.run or args.model).endswith(("draft", "hf")) else model), tok

    monkeypatch.setattr(cli, "load_model", load_model)
    argv = ["generate", "--run", str(tmp_path), "--prompt", "bcdebcdfbcd", "--max-new-tokens", "12",
            "--temperature", "0"]
    outs = []
    for extra in ([], ["--speculative", "ngram", "--draft-tokens", "3"], ["--speculative", str(tmp_path / "draft")],
                  ["--speculative", str(tmp_path / "hf")],
                  ["--logit-bias", "3=-100", "--presence-penalty", "1", "--ignore-eos", "--speculative", "ngram"]):
        assert main(argv + extra) == 0
        captured = capsys.readouterr()
        outs.append(captured.out)
        if "--logit-bias" in extra:                              # the options through the CLI: plain's output
            assert main(argv + extra[:-2]) == 0 and capsys.readouterr().out == outs[-1]
    assert outs[0] == outs[1] == outs[2] == outs[3] != outs[4] and "tokens per step" in captured.err
    assert loaded.count(str(tmp_path / "draft")) == 1 and loaded.count("model " + str(tmp_path / "hf")) == 1
    for nowhere in ("nowhere", "nowhere.gguf"):
        assert main(argv + ["--speculative", str(tmp_path / nowhere)]) != 0
        assert "--speculative must be 'ngram', 'mtp' or a draft model's folder" in capsys.readouterr().err


def test_the_cli_stop_text_ends_the_output_where_the_text_first_holds_it(tmp_path, capsys, monkeypatch):
    """``subquad generate --stop TEXT`` as the server's ``stop``: TEXT matched on the decoded text across tokens
    (two-character tokens among them), the output ending just before its first occurrence - against the same
    seeded call without it, cut there by str.find, plain and speculating, one prompt and a prompts file whose
    rows stop at different places; a special token's text ("</s>", which decoding leaves out) ends it at that
    token, its text left out as --stop-token-id's; an option generate refuses prints no prompt."""
    from types import SimpleNamespace

    import subquad.cli.generate as cli
    from subquad.cli import main

    model = tiny("mamba2,softmax", scale=3.0)
    pieces = ["a", "b", "c", "d", "e", "f", "g", "h", "ij", "k\n", ""]   # "ij", "k\n": two characters; 10: "</s>"

    def encode(s, add_special_tokens=True):                     # longest pieces first; other text dropped
        ids = []
        while s:
            if s.startswith("</s>"):
                ids, s = ids + [10], s[4:]
                continue
            two = s[:2] in pieces[8:10]
            if two or s[0] in pieces[:8]:
                ids.append(pieces.index(s[:2] if two else s[0]))
            s = s[2 if two else 1:]
        return SimpleNamespace(ids=ids)

    tok = SimpleNamespace(encode=encode, decode=lambda ids: "".join(pieces[i] for i in ids))
    monkeypatch.setattr(cli, "load_model", lambda args, need_tokenizer=None: (model, tok))
    prompt = "bcdebcdfbcd"
    argv = ["generate", "--run", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "1",
            "--seed", "4", "--ignore-eos"]
    for extra in ([], ["--speculative", "ngram", "--draft-tokens", "3"]):
        assert main(argv + extra) == 0
        full = capsys.readouterr().out[len(prompt):-1]
        middle = full[len(full) // 2:len(full) // 2 + 2]
        assert len(set(full)) >= 4 and full.find(middle) > 0
        for stop in (middle, full[-3:], "\n", "zz"):            # "zz" never occurs
            want = full[:full.find(stop)] if stop in full else full
            assert main(argv + extra + ["--stop", stop.replace("\n", "\\n")]) == 0
            assert capsys.readouterr().out == prompt + want + "\n", (extra, stop)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt + "\n" + prompt[:5] + "\n")
    flags = ["--max-new-tokens", "24", "--temperature", "1", "--seed", "4", "--ignore-eos"]
    assert main(["generate", "--run", str(tmp_path), "--prompts-file", str(prompts)] + flags) == 0
    rows = [line.split("] ", 1)[1] for line in capsys.readouterr().out.split("--- [")[1:]]
    stop = "d"                                                  # each row's first "d" after its prompt
    assert main(["generate", "--run", str(tmp_path), "--prompts-file", str(prompts), "--stop", stop] + flags) == 0
    out = capsys.readouterr().out
    for p, row in zip((prompt, prompt[:5]), rows, strict=True):
        text = row[len(p):].rstrip("\n")
        assert f"{p}{text[:text.find(stop)] if stop in text else text}\n" in out
    new = model.generate([pieces.index(c) for c in prompt], 24, temperature=1.0, seed=4, ignore_eos=True)[0]
    assert 0 < new.index(10) < 23                               # "</s>", its text "": the stop at its token
    assert main(argv + ["--stop", "</s>"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(new[:new.index(10)]) + "\n"
    assert main(argv + ["--stop", "a</s>"]) != 0
    assert "holds a special token (id 10)" in capsys.readouterr().err
    assert main(argv + ["--logit-bias", "99=1"]) != 0                      # refused by generate: no prompt shown
    captured = capsys.readouterr()
    assert captured.out == "" and "logit_bias" in captured.err


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_on_token_returning_true_ends_that_row_there(spec):
    """``generate(on_token=...)`` returning exactly True ends that sequence at that token: batch rows ending at
    their own steps equal each row alone with max_new_tokens at that count - plain, by prompt lookup (the end
    inside a run of kept drafts) and with a draft model; a lone sequence's state continues as plain decoding
    does; other truthy returns are ignored."""
    model = tiny("mamba2,softmax", scale=6.0)
    drafter = {None: None, "ngram": "ngram", "draft": _draft_for(model, noise=0.1)}[spec]
    kw = dict(temperature=0, ignore_eos=True) | ({} if spec is None else dict(speculative=drafter, draft_tokens=3))
    prompts, ends = [PROMPT, PROMPT[:7], PROMPT[2:]], [5, 11, 17]
    seen = [[] for _ in prompts]

    def on(i, t):
        seen[i].append(t)
        return len(seen[i]) == ends[i] or 1                     # 1: truthy, not True - ignored

    got, _ = model.generate(prompts, 24, on_token=on, **kw)
    assert got == [model.generate(p, n, temperature=0, ignore_eos=True)[0] for p, n in zip(prompts, ends)]
    if spec == "ngram":
        assert model.speculation_stats.accepted >= 2
    n, more = 9, 6
    first, state = model.generate(PROMPT, 24, on_token=lambda t, c=[]: c.append(t) or len(c) == n, **kw)
    full = model.generate(PROMPT, n + more, temperature=0, ignore_eos=True)[0]
    assert first == full[:n]
    assert model.generate([first[-1]], more, state=state, temperature=0, ignore_eos=True)[0] == full[n:]


@pytest.mark.paced
def test_the_pacer_verifies_only_while_it_pays_against_a_plain_step():
    p = Pacer()
    assert not p.want()                                         # no plain step measured yet
    p.measured(60.0)                                            # the first compiled a graph: t_p(1) 60 s for now
    assert not p.want()                                         # WARMUP: a second plain step first
    p.measured(0.004)                                           # min(0.004, 1.5 x 60)
    assert p.plain == {1: 0.004} and p.want()
    p.measured(0.006)                                           # grows at most 1.5x per plain step
    assert p.plain == {1: 0.006}
    p.measured(0.010)
    assert p.plain == {1: pytest.approx(0.009)}
    p.measured(0.008)
    assert p.plain == {1: 0.008}
    # 3 tokens per row for 0.020 s against 0.008 s per plain token pays (r = 2.5 <= 3) - until the plain step
    # after it costs 0.016 s more than a plain step (the state's layout changed back): r + 0.3 x 2, then not
    p.measured(0.020, 3.0)
    assert p.ratio == pytest.approx(2.5) and p.pause == 0 and p.want()
    p.measured(0.024)
    assert p.ratio == pytest.approx(3.1) and p.pause == 1 and p.plain == {1: 0.008}
    # this verification lost 4.5 - 3 = 1.5 plain steps' time, the averages (r 3.1, g 3) 0.1: drafting waits the
    # steps that keep the lesser within BUDGET (5%) of their time: ceil(0.1 / 0.05) (2, and 3 for the rounding)
    assert [p.want() for _ in range(4)] == [False] * 3 + [True]
    # verifying costs 0.012 s for 1 token per row, a plain step 0.008 s per token (r 1.5): it does not pay;
    # drafting waits 2, 4, 8, ... up to MAX_WAIT plain steps, and at least the steps that keep what it lost -
    # the last verification's r - g or the averages', the lesser - within a budget of BUDGET halved by each
    # failure in a row (the one above was the first), down to BUDGET / 2 ** BACKOFF
    ratio, gain, fails = 3.1, 3.0, 1

    def expected(r):
        nonlocal ratio, gain, fails
        ratio, gain, fails = 0.7 * ratio + 0.3 * r, 0.7 * gain + 0.3 * 1.0, fails + 1
        budget = Pacer.BUDGET / 2 ** min(fails - 1, Pacer.BACKOFF)
        return min(max(2 ** min(fails - 1, 6), math.ceil(min(r - 1.0, ratio - gain) / budget)), Pacer.LONGEST)

    def waits(seconds, times=8):
        out = []
        for _ in range(times):
            p.measured(seconds, 1.0)
            n = 0
            while not p.want():
                n += 1
            out.append(n)
        return out
    want = [expected(1.5) for _ in range(8)]
    assert waits(0.012) == want and want[:3] == [9, 25, 59] and want[-1] == 153   # towards 0.5 / (0.05 / 16)
    want = [expected(12.5) for _ in range(2)]
    assert waits(0.100, 2) == want and want[0] == 1211       # 11.5 steps lost, the averages' 3.8 set it
    p.measured(0.012, 4.0)                                      # pays (the last alone): the budget is BUDGET again
    assert p.pause == 0 and p.keys[None].fails == 0 and p.want()
    p.measured(0.012, 1.0)
    assert p.keys[None].fails == 1 and p.wait == math.ceil(min(0.5, p.ratio - p.gain) / Pacer.BUDGET)
    for _ in range(7):                                          # a wait is never longer than LONGEST
        p.measured(10.0, 1.0)
    assert p.wait == Pacer.LONGEST


@pytest.mark.paced
def test_a_step_that_compiled_or_loaded_a_graph_is_not_heard(monkeypatch):
    """A graph built or loaded between ``start`` and ``measured`` (``CompiledStep.made``, dynamo's count) makes
    the step a measure of that, not of a step: the pacer ignores it; the next step is heard."""
    from subquad.models.decode import CompiledStep
    from subquad.models.speculative import graphs_built

    p = Pacer()
    for _ in range(2):
        p.start()
        p.measured(0.004)
    assert p.want()
    before = graphs_built()
    p.start()
    monkeypatch.setattr(CompiledStep, "made", CompiledStep.made + 1)     # a verification that loaded its graph
    assert graphs_built() == before + 1
    p.measured(0.500, 2.0)
    assert p.ratio is None and p.keys == {} and p.since == 0 and p.want()
    p.start()
    p.measured(0.006, 2.0)                                      # heard: r 1.5 for 2 tokens
    assert p.ratio == pytest.approx(1.5) and p.gain == 2.0 and p.measured_plain == 2


@pytest.mark.paced
def test_generate_and_the_server_keep_a_models_pacer_between_calls():
    """``pacer_for``: one pacer per model, drafter and draft_tokens, kept between generate calls and shared with a
    serving engine over the model - what it measured stays (a batch whose verifications never pay need not probe
    again at every call) - each call starting without a verification's aftermath."""
    from subquad.models.speculative import pacer_for
    from subquad.serve import Engine

    model = tiny("mamba2,softmax", scale=1.0)
    plain = model.generate(PROMPT, 3, temperature=0)[0]
    # the first token comes from the prefill, then WARMUP plain steps: nothing verified yet
    assert model.generate(PROMPT, 3, temperature=0, speculative="ngram", draft_tokens=3)[0] == plain
    p = pacer_for(model, "ngram", 3)
    assert model.speculation_stats.verifications == 0 and p.measured_plain == Pacer.WARMUP and 1 in p.plain
    p.after = True
    # the second call's pacer has measured its plain steps: it verifies at once
    assert model.generate(PROMPT, 3, temperature=0, speculative="ngram", draft_tokens=3)[0] == plain
    assert pacer_for(model, "ngram", 3) is p and model.speculation_stats.verifications > 0
    p.after = True
    assert Engine(model, speculative="ngram", draft_tokens=3, state_cache_mb=0).pacer is p and not p.after
    assert pacer_for(model, "ngram", 4) is not p and pacer_for(tiny("mamba2", scale=1.0), "ngram", 3) is not p


@pytest.mark.paced
def test_the_pacer_judges_each_batch_against_plain_steps_of_its_size():
    """The server's batch grows as rows join: a verification at 16 rows is set against a plain step at 16 rows (or
    the nearest batch measured), not against the one-row step measured first; a plain step at a larger batch
    caps the smaller ones' (the graph compiled at batch 1 is forgotten)."""
    p = Pacer()
    p.measured(30.0, batch=1)                                   # compiled the step
    p.measured(0.010, batch=16)
    assert p.plain == {1: 0.010, 16: 0.010}
    p.measured(0.005, batch=1)
    assert p.plain == {1: 0.005, 16: 0.010} and p.t_plain(12) == 0.010 and p.t_plain(3) == 0.005
    assert p.want()
    p.measured(0.012, 2.0, batch=1)                             # 2.4x a one-row step for 2 tokens: does not pay
    assert p.ratio == pytest.approx(2.4) and p.pause == 1
    p = Pacer()
    for b in (1, 1, 16):
        p.measured(0.005 if b == 1 else 0.010, batch=b)
    p.measured(0.018, 2.0, batch=16)                            # 1.8x a 16-row step for 2 tokens: pays
    assert p.ratio == pytest.approx(1.8) and p.pause == 0 and p.want()
    p.measured(0.018, 2.0, batch=15)                            # 15 rows: against 16's step, the nearest
    assert p.ratio == pytest.approx(1.8) and p.pause == 0


@pytest.mark.paced
def test_a_verification_that_pays_by_itself_goes_on_before_the_averages_catch_up():
    """Text that starts repeating itself: the averages still say no (g 1.9 < r 3), the last verification's 5
    tokens for 3 plain steps' time says yes - verifying goes on at once."""
    p = Pacer()
    p.measured(0.010)
    p.measured(0.010)
    p.measured(0.030, 1.0)                                      # r 3, g 1: waits 2 / BUDGET plain steps
    assert p.pause == 1 and [p.want() for _ in range(41)] == [False] * 40 + [True]
    p.measured(0.030, 5.0)                                      # averages: g 2.2 < r 3; this one: 5 >= 3
    assert p.gain == pytest.approx(2.2) and p.ratio == pytest.approx(3.0)
    assert p.pause == 0 and p.want()


@pytest.mark.paced
def test_the_pacer_judges_each_key_on_its_own():
    """Keys (prompt lookup's match lengths) keep their own gains and waits against the one measured cost: a key
    whose drafts fail waits while another's that pay go on, and its wait counts every step - asked under any key
    or passed without asking."""
    p = Pacer()
    p.measured(0.010)
    p.measured(0.010)                                           # t_p 10 ms
    p.measured(0.015, 1.0, key=1)                               # r 1.5 for 1 token: 0.5 steps lost, waits 10
    assert p.keys[1].pause == 1 and p.keys[1].wait == 10 and p.wait == 0
    assert p.want(3)                                            # key 3 not judged yet (key 1: 9 left)
    p.measured(0.015, 4.0, key=3)                               # 4 tokens for 1.5 steps: pays
    assert p.keys[3].gain == 4.0 and p.keys[3].wait == 0 and p.ratio == pytest.approx(1.5)
    assert p.want(3)                                            # key 1: 8 left
    p.passed()                                                  # 7
    assert [p.want(1) for _ in range(8)] == [False] * 7 + [True]
    assert p.want(None) and p.gain is None                      # no verification of key None yet


def slow_verification(monkeypatch, module, seconds=0.025):
    """``module.verify`` made ``seconds`` slower, and the pacer probing after 2 verifications (the pacer's tests)."""
    import time

    real = module.verify

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)
    monkeypatch.setattr(module, "verify", slow)
    monkeypatch.setattr(Pacer, "PROBE", 2)


@pytest.mark.paced
def test_speculation_backs_off_when_verifying_costs_more_than_it_emits(monkeypatch):
    """A verification made slow on purpose (25 ms more): generate soon decodes with plain steps, same tokens."""
    from subquad.models import generate as generate_mod

    model = tiny("mamba2,softmax", scale=1.0)                    # repeats itself: drafts accepted
    plain = model.generate(PROMPT, 60, temperature=0)[0]
    slow_verification(monkeypatch, generate_mod)
    assert model.generate(PROMPT, 60, temperature=0, speculative="ngram", draft_tokens=2)[0] == plain
    st = model.speculation_stats
    assert st.verifications < st.steps / 3, (st.verifications, st.steps)


@pytest.mark.paced
def test_a_probe_measures_a_plain_step_after_the_verifications_aftermath():
    """Drafts that never fail: after PROBE verifications the pacer takes plain steps until one is measured - the
    first after a verification is that verification's aftermath (charged to it), the second measures t_p."""
    p = Pacer()
    p.measured(0.004)
    p.measured(0.004)                                           # t_p known: 4 ms
    for _ in range(Pacer.PROBE):
        assert p.want()
        p.measured(0.008, 4.0)                                  # pays: 4 tokens for 2 plain steps' time
    assert not p.want()
    p.measured(0.010)                                           # the aftermath: +6 ms (1.5 t_p) on r, t_p untouched
    assert p.plain == {1: 0.004} and p.ratio == pytest.approx(2.0 + 0.3 * 1.5)
    assert not p.want()                                         # the probe goes on
    p.measured(0.005)
    assert p.plain == {1: pytest.approx(0.005)} and p.want()


def test_the_compiled_verification_keeps_the_states_per_token_and_decodes_as_plain_greedy(tmp_path):
    """After ``compile_decode`` a verification runs one graph (``CompiledStep.verifier``) that keeps each recurrent
    layer's state after every token: its logits and accepted states equal a prefill of the kept tokens (the KV
    cache truncated, by a different count per row in two rows); greedy speculation through it is plain greedy
    decoding, drafts padded to ``draft_tokens`` so that one graph serves every step (the eager "states" cases above
    check the rest, rows included)."""
    from subquad.models.decode import compile_decode

    model = tiny("mamba,softmax", scale=6.0)
    plain = model.generate(PROMPT, 14, temperature=0)[0]
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
    plain6 = model.generate(prompts, 14, temperature=0)[0]
    compile_decode(model, cache=tmp_path)
    # two drafts (graphs of 3 tokens): each graph unrolls the recurrences over its tokens, ~10 s a token to build
    assert model.generate(PROMPT, 14, temperature=0, speculative="ngram", draft_tokens=2)[0] == plain
    assert model.speculation_stats.verifications > 0
    with torch.no_grad():
        assert_rollback_is_a_prefill(model, "compiled", k=3, how="compiled")
    assert model._decode_step.verifier().shapes == {(1, 3), (2, 3)}    # every step the same k: a graph per batch
    # 6 rows x 3 tokens pass C_ROWS' 16: they pad to one draft each (compiled_budget), a graph of 2 tokens
    from subquad.models.speculative import compiled_budget

    assert [compiled_budget(model, b, 2) for b in (1, 2, 5, 6, 8)] == [2, 2, 2, 1, 1]
    assert [compiled_budget(model, b, 4) for b in (1, 2, 3, 4, 8)] == [4, 4, 4, 1, 1]
    assert model.generate(prompts, 14, temperature=0, speculative="ngram", draft_tokens=2)[0] == plain6
    assert model._decode_step.verifier().shapes == {(1, 3), (2, 3), (6, 2)}


def test_after_compile_decode_a_mamba_model_verifies_through_its_block_calls(tmp_path):
    """A model of plain Mamba-1 blocks (mamba-130m's structure) whose blocks verify as one C call each
    (``TokensStep``) keeps doing so after ``compile_decode``: no verification graph is built, the state after
    accepting j equals a prefill of those j; with an MLP in the blocks, or more rows times tokens than
    ``layers.linear.C_ROWS``, the compiled verification is the choice."""
    from subquad.models.decode import compile_decode
    from subquad.models.speculative import _mamba_calls

    model = tiny("mamba", scale=3.0, mlp=False).float()
    compile_decode(model, cache=tmp_path)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        _, start = model.prefill(torch.randint(0, 11, (2, 6), generator=g), logits="last")
        drafts = torch.randint(0, 11, (2, 5), generator=g)
        logits, ver = model.verify(drafts, start)
        assert type(ver).__name__ == "KeptStates" and model._decode_step._verifier is None
        got, (want_logits, want) = ver.accept(3), model.prefill(drafts[:, :3], start)
        torch.testing.assert_close(logits[:, :3], want_logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(got, want, strict=True):
            assert same_state(a, b, atol=1e-5) is None
    assert _mamba_calls(model, drafts) and not _mamba_calls(model, torch.zeros(4, 5, dtype=torch.long))
    assert not _mamba_calls(tiny("mamba", mlp=True).float(), drafts)


def test_an_eager_mamba_verification_keeps_its_states_from_the_scan_kernel():
    """Eagerly, a model whose recurrent parts keep their per-token states in one call (Mamba's scan kernel,
    ``per_token_states``) verifies by keeping them (``KeptStates``: accept picks, nothing replays); another
    recurrence replays, and so does a float64 Mamba (no kernel: a per-token loop would cost more than the replay).
    float32: the kernel's path; the state after accepting j equals a prefill of those j."""
    from subquad.ops.mamba import fused_scan

    model = tiny("mamba,softmax", scale=3.0).float()
    other = tiny("gla,softmax").float()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        _, start = model.prefill(torch.randint(0, 11, (2, 6), generator=g), logits="last")
        drafts = torch.randint(0, 11, (2, 5), generator=g)
        logits, ver = model.verify(drafts, start)
        assert type(ver).__name__ == "KeptStates" and fused_scan.KERNEL.available()
        got, (want_logits, want) = ver.accept(3), model.prefill(drafts[:, :3], start)
        torch.testing.assert_close(logits[:, :3], want_logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(got, want, strict=True):
            assert same_state(a, b, atol=1e-5) is None
        _, o_start = other.prefill(drafts, logits="last")
        assert type(other.verify(drafts, o_start)[1]).__name__ == "Verification"
        wide = tiny("mamba,softmax")                                     # float64: no kernel, so it replays
        _, w_start = wide.prefill(drafts, logits="last")
        assert type(wide.verify(drafts, w_start)[1]).__name__ == "Verification"


def test_a_replayed_shared_block_keeps_the_state_order_and_a_row_joins_after_it():
    """A Zamba2-style model (a shared attention block beside Mamba-2 in layers 1 and 2): the replayed rollback of
    two rows keeping 2 and 3 tokens holds each layer's entries in a prefill's order and equals that prefill;
    a third row's fresh state joins it (``rows.cat_states``, by entry name) - before, a request joining a served
    batch after a verification failed on the order."""
    from subquad.models.rows import cat_states, select_rows
    from subquad.models.speculative import verify

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=11, d_model=16, n_layers=3, n_heads=2, pattern="mamba2",
                                      shared={"layers": [1, 2], "blocks": 1, "adapter_rank": 4})).double().eval()
    g = torch.Generator().manual_seed(1)
    prompt, drafts = torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 4), generator=g)
    with torch.no_grad():
        _, start = model.prefill(prompt)
        _, ver = verify(model, drafts, start, how="replay")
        kept = ver.accept([2, 3])
        for b, n in enumerate((2, 3)):
            _, want = model.prefill(torch.cat([prompt[b:b + 1], drafts[b:b + 1, :n]], 1))
            assert [list(layer) for layer in kept] == [list(layer) for layer in want]
            got, _ = model.step(torch.tensor([4]), select_rows(kept, [b]))
            torch.testing.assert_close(got, model.step(torch.tensor([4]), want)[0], rtol=1e-10, atol=1e-10)
        _, other = model.prefill(torch.randint(0, 11, (1, 4), generator=g))
        joined = cat_states([kept, other])
        logits, _ = model.step(torch.tensor([1, 2, 3]), joined)
        alone, _ = model.step(torch.tensor([3]), other)
    torch.testing.assert_close(logits[2:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_one_seeded_row_samples_the_tokens_it_samples_without_speculation(speculative):
    """One row with a seed: each verified position drawn in order with plain sampling's own draws
    (``draw_in_order``), so the tokens are plain sampling's with that seed - a drafter that repeats the prompt and
    a draft model (a batch keeps the rejection rule: distributed as plain sampling, the test above)."""
    model = tiny("mamba2,softmax", scale=2.0, vocab=5)
    draft = tiny("gla", n_layers=1, vocab=5, scale=2.0) if speculative == "draft" else "ngram"
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for seed in range(6):
        for options in ({}, dict(top_k=3, repetition_penalty=1.3)):
            plain, _ = model.generate(prompt, 24, temperature=0.9, seed=seed, **options)
            got, _ = model.generate(prompt, 24, temperature=0.9, seed=seed, speculative=draft, **options)
            assert got == plain, (seed, options)
    st = model.speculation_stats
    assert st.verifications > 0 and 0 < st.accepted < st.drafted      # drafts were kept and refused


def test_a_draft_model_with_learned_positions_is_held_to_them():
    """A draft model reads the prompt, every token and its drafts ahead: with learned positions (context 24 here)
    a generation that would take it past them failed part-way (a new user's trial: `--speculative DIR` of such a
    run, 70 tokens in) - now refused before the first token, naming the draft and the room; within them it is
    plain greedy decoding. The server refuses such a draft for a max_context it cannot reach."""
    from subquad.serve import Engine

    model = tiny("mamba2", scale=10.0)
    draft = LanguageModel(ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, pattern="gla",
                                      pos_emb="learned", context_length=24)).double().eval()
    prompt = PROMPT[:8]
    with pytest.raises(ValueError, match=r"speculative: the draft model's learned positions end at "
                                         r"context_length=24; .* ask for at most 14 new tokens or use a draft"):
        model.generate(prompt, 15, temperature=0, speculative=draft, draft_tokens=3)
    plain = model.generate(prompt, 14, temperature=0)[0]
    assert model.generate(prompt, 14, temperature=0, speculative=draft, draft_tokens=3)[0] == plain
    with pytest.raises(ValueError, match="pass the draft model's learned positions .* max_context at most 20"):
        Engine(model, max_context=21, speculative=draft, draft_tokens=4)
    Engine(model, max_context=20, speculative=draft, draft_tokens=4)
