"""RWKV-7 checkpoints against BlinkDL's own ``rwkv`` package (``RWKV_x070``, strategy "cpu fp32": its
per-token loop, which runs on torch 2.13's CPU): random-weight ``.pth`` files of the package's layout, loaded
by ``from_pretrained``, give the package's logits and recurrent states; greedy decoding picks its tokens;
prefill-then-decode and packed sequences equal one forward; fla-hub's Hugging Face layout, written here from
the ``.pth`` by a mapping of this file's own, loads to the same logits and saves back to the same tensors."""

import json
import os

import pytest
import torch

os.environ["RWKV_V7_ON"] = "1"            # read by rwkv.model at import: the RWKV-7 classes
# the `rwkv` extra installs it (make test requires it); the library never imports it
rwkv_model = pytest.importorskip("rwkv.model")

from subquad.models import LanguageModel, ModelConfig, from_pretrained  # noqa: E402
from subquad.testing import random_rwkv7_pth  # noqa: E402

V, D, L, N = 97, 128, 3, 64                # vocab, width, layers, head size (the package fixes HEAD_SIZE = 64)
RANKS = {"w": 16, "a": 16, "v": 8, "g": 32}
MLP = 4 * D


def random_pth(path, seed=0):
    """A random RWKV-7 checkpoint in BlinkDL's layout at this file's shape, at ``path``."""
    return random_rwkv7_pth(path, V, D, L, RANKS, MLP, N, seed=seed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the .pth's tensors, its path, the package's model of it, ours)."""
    folder = tmp_path_factory.mktemp("rwkv7")
    path = folder / "model.pth"
    z = random_pth(path)
    ref = rwkv_model.RWKV(str(folder / "model"), "cpu fp32")     # the package appends ".pth"
    model, tok = from_pretrained(path)
    assert tok is None
    return z, path, ref, model


def ref_forward(ref, tokens, state=None):
    """The package's logits (T, V) for ``tokens`` and its state after them (the state passed in kept)."""
    state = None if state is None else [s.clone() for s in state]
    if len(tokens) == 1:
        out, state = ref.forward(tokens, state)
        return out.view(1, -1), state
    return ref.forward(tokens, state, full_output=True)


def tokens(T, seed):
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sizes_are_read_off_the_tensors(ckpt):
    cfg = ckpt[3].config
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_hidden) == (V, D, L, D // N, MLP)
    o = cfg.mixer_options["rwkv7"]
    assert (o["decay_rank"], o["a_rank"], o["v_rank"], o["gate_rank"]) == (16, 16, 8, 32)


def test_logits_and_states_equal_the_package(ckpt):
    _, _, ref, model = ckpt
    idx = tokens(23, 1)
    want, ref_state = ref_forward(ref, idx)
    with torch.no_grad():
        got, state = model.prefill(torch.tensor([idx]))
    assert want.abs().max() > 1                                    # logits of a useful scale
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-4)
    for i, s in enumerate(state):
        torch.testing.assert_close(s["shift"].view(D), ref_state[3 * i], rtol=0, atol=1e-5)
        # the package holds the state as (H, V, K): S^T of ours (H, K, V)
        torch.testing.assert_close(s["S"][0], ref_state[3 * i + 1].transpose(-1, -2), rtol=0, atol=1e-4)
        torch.testing.assert_close(s["mlp.shift"].view(D), ref_state[3 * i + 2], rtol=0, atol=1e-5)


def test_greedy_decoding_picks_the_package_tokens(ckpt):
    _, _, ref, model = ckpt
    prompt = tokens(7, 2)
    out, state = ref_forward(ref, prompt)
    want = []
    for _ in range(32):
        want.append(int(out[-1].argmax()))
        out, state = ref_forward(ref, [want[-1]], state)
    got, _ = model.generate([prompt], 32, temperature=0)
    assert got[0] == want


def test_prefill_then_decode_and_packed_equal_one_forward(ckpt):
    model = ckpt[3]
    idx = torch.tensor([tokens(19, 3), tokens(19, 4)])
    with torch.no_grad():
        full = model(idx)
        logits, state = model.prefill(idx[:, :11])
        steps = [logits]
        for t in range(11, 19):
            lt, state = model.step(idx[:, t], state)
            steps.append(lt[:, None])
        tol = 1e-5 * full.abs().max()                 # float32 rounding: one token's matmuls associate differently
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=tol)
        lengths = [5, 1, 9, 4]
        seqs = [tokens(n, 10 + j) for j, n in enumerate(lengths)]
        cu = torch.tensor([0] + lengths).cumsum(0)
        packed, pstate = model.prefill(torch.tensor([sum(seqs, [])]), cu_seqlens=cu)
        for j, s in enumerate(seqs):
            alone, astate = model.prefill(torch.tensor([s]))
            torch.testing.assert_close(packed[0, cu[j]:cu[j + 1]], alone[0], rtol=0, atol=tol)
            for layer, layer_alone in zip(pstate, astate):
                for key in ("S", "shift", "mlp.shift"):
                    torch.testing.assert_close(layer[key][j:j + 1], layer_alone[key], rtol=0, atol=1e-5)


def fla_folder(z, folder):
    """fla-hub's layout of the checkpoint ``z``, written from BlinkDL's names by this test's own map
    (fla's ``RWKV7ForCausalLM``: ``lora.0`` is W1^T, ``lora.2`` is W2^T with bias w0; no v_lora in layer 0)."""
    t = {"model.embeddings.weight": z["emb.weight"], "lm_head.weight": z["head.weight"]}
    for n in ("weight", "bias"):
        t[f"model.norm.{n}"], t[f"model.layers.0.pre_norm.{n}"] = z[f"ln_out.{n}"], z[f"blocks.0.ln0.{n}"]
    for i in range(L):
        a, o = f"blocks.{i}.att.", f"model.layers.{i}."
        for n in ("weight", "bias"):
            t[o + f"attn_norm.{n}"], t[o + f"ffn_norm.{n}"] = z[f"blocks.{i}.ln1.{n}"], z[f"blocks.{i}.ln2.{n}"]
            t[o + f"attn.g_norm.{n}"] = z[a + f"ln_x.{n}"]
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            t[o + "attn." + n] = z[a + n]                                        # (1, 1, D) in both
        for n in ("k_k", "k_a"):
            t[o + "attn." + n] = z[a + n].flatten()
        t[o + "attn.r_k"] = z[a + "r_k"]
        for ours, theirs in (("receptance", "r"), ("key", "k"), ("value", "v"), ("output", "o")):
            t[o + f"attn.{theirs}_proj.weight"] = z[a + ours + ".weight"]
        for n in RANKS:
            if n == "v" and i == 0:
                continue
            t[o + f"attn.{n}_lora.lora.0.weight"] = z[a + n + "1"].T.contiguous()
            t[o + f"attn.{n}_lora.lora.2.weight"] = z[a + n + "2"].T.contiguous()
            if n != "g":
                t[o + f"attn.{n}_lora.lora.2.bias"] = z[a + n + "0"].flatten()
        t[o + "ffn.x_k"] = z[f"blocks.{i}.ffn.x_k"].flatten()
        for n in ("key", "value"):
            t[o + f"ffn.{n}.weight"] = z[f"blocks.{i}.ffn.{n}.weight"]
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "vocab_size": V, "hidden_size": D,
        "num_hidden_layers": L, "head_dim": N, "decay_low_rank_dim": RANKS["w"], "a_low_rank_dim": RANKS["a"],
        "v_low_rank_dim": RANKS["v"], "gate_low_rank_dim": RANKS["g"], "intermediate_size": MLP,
        "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True, "norm_eps": 1e-5, "attn": None,
        "tie_word_embeddings": False, "fuse_norm": True}))
    return t


def test_fla_layout_loads_to_the_package_logits_and_saves_back(ckpt, tmp_path):
    z, _, ref, _ = ckpt
    written = fla_folder(z, tmp_path / "fla")
    model, _ = from_pretrained(tmp_path / "fla")
    idx = tokens(17, 5)
    with torch.no_grad():
        got = model(torch.tensor([idx]))[0]
    torch.testing.assert_close(got, ref_forward(ref, idx)[0], rtol=0, atol=1e-4)
    model.save_pretrained(tmp_path / "saved")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == written.keys()
    for k in written:
        assert torch.equal(saved[k], written[k]), k
    again, _ = from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again(torch.tensor([idx]))[0], got, rtol=0, atol=0)


def test_what_cannot_be_read_is_refused(ckpt, tmp_path):
    z = dict(ckpt[0])
    z.pop("blocks.1.att.k_a")
    torch.save(z, tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="missing.*blocks.1.att.k_a"):
        from_pretrained(tmp_path / "missing.pth")
    z = dict(ckpt[0], **{"blocks.0.ffn.s_emb.weight": torch.zeros(V, 1024)})    # DeepEmbed
    torch.save(z, tmp_path / "de.pth")
    with pytest.raises(ValueError, match="unexpected.*s_emb"):
        from_pretrained(tmp_path / "de.pth")
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.pth", "b.pth"):
        (two / n).write_bytes(b"")
    with pytest.raises(ValueError, match="several .pth"):
        from_pretrained(two)
    fla_folder(ckpt[0], tmp_path / "fla")
    c = json.loads((tmp_path / "fla" / "config.json").read_text())
    for key, value in (("attn", {"layers": [1]}), ("hidden_act", "gelu"), ("value_dim", 2 * D)):
        (tmp_path / "fla" / "config.json").write_text(json.dumps({**c, key: value}))
        with pytest.raises(ValueError, match=key):
            from_pretrained(tmp_path / "fla")


def test_the_block_options_are_checked_and_a_built_model_holds_rwkv_blocks():
    for field, value in (("norm", "batch"), ("mlp_kind", "gelu"), ("embed_norm", 1)):
        with pytest.raises(ValueError, match=field):
            ModelConfig(pattern="rwkv7", **{field: value})
    with pytest.raises(ValueError, match="moe"):
        ModelConfig(pattern="rwkv7", mlp_kind="rwkv7", moe={"experts": 2})
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, pattern="rwkv7", mlp_kind="rwkv7",
                      norm="layer", embed_norm=True)
    model = LanguageModel(cfg)
    assert isinstance(model.embed_norm, torch.nn.LayerNorm) and isinstance(model.blocks[1].norm2, torch.nn.LayerNorm)
    state = model.empty_state(3)
    assert set(state[0]) == {"S", "shift", "mlp.shift"} and state[0]["mlp.shift"].shape == (3, 1, 32)


def test_a_model_of_rwkv7_layers_with_the_defaults_names_what_the_rwkv7_type_needs(tmp_path):
    """``subquad train --pattern rwkv7`` builds RWKV-7 mixers in the default blocks (RMS norms, a SwiGLU MLP, no
    embedding norm), which no Hugging Face type holds: the refusal names the nearest type and each field it needs
    (the README's RWKV-7 configuration), and that configuration is saved as rwkv7."""
    from subquad.models.hf.saver import save_pretrained

    plain = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern="rwkv7")
    with pytest.raises(ValueError, match=r"nearest: rwkv7, which needs mlp_kind='rwkv7' \(this model: 'swiglu'\), "
                                         r"norm='layer' \(this model: 'rms'\), embed_norm=True"):
        save_pretrained(LanguageModel(plain), tmp_path / "plain")
    with pytest.raises(ValueError, match=r"nearest: rwkv7, which needs rwkv7\.norm_eps=0\.00032 \(this model"):
        save_pretrained(LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern="rwkv7",
                                                  mlp_kind="rwkv7", norm="layer", embed_norm=True, norm_eps=1e-5)),
                        tmp_path / "eps")                    # the group norm's eps: head size x the norms' eps
    fixed = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern="rwkv7", mlp_kind="rwkv7",
                        norm="layer", embed_norm=True, norm_eps=1e-5, mixer_options={"rwkv7": {"norm_eps": 32e-5}})
    save_pretrained(LanguageModel(fixed), tmp_path / "fixed")
    assert json.loads((tmp_path / "fixed" / "config.json").read_text())["model_type"] == "rwkv7"
