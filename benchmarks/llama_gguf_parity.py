"""Does llama.cpp compute the same model from the GGUF files subquad writes (``save_gguf``)? Logits at every
position of a short prompt from llama.cpp (llama-cpp-python's bindings over a natively built ``libllama``)
against subquad's: float32 files against the float model, q8_0 files against subquad's own load of the same
file (``from_pretrained("x.gguf")``: Q8_0 kept as per-block int8).

    python benchmarks/llama_gguf_parity.py --llama-src LLAMA_PY_SRC [--pythonpath DIR]

LLAMA_PY_SRC: an unpacked llama-cpp-python sdist whose ``vendor/llama.cpp/build/bin`` holds the built libraries
(see RESULTS.md "Decoding against llama.cpp" for the build); ``--pythonpath``: where its Python dependencies
(diskcache) are, if not installed. Tiny random Mamba-1, Mamba-2, Falcon-Mamba, LFM2, Qwen3-Next (qwen3next),
Qwen3.5 dense and MoE (qwen35, qwen35moe), LFM2-MoE (lfm2_moe), Kimi-Linear (kimi_linear), RWKV-7 (rwkv7) and
the Mamba-2 hybrids (Granite 4 with experts and multipliers, Granite 4 dense, Bamba, Nemotron-H with and without
experts, Falcon-H1 with its muP multipliers, Jamba: the parity tests' models) and MiniMax (minimax-01: the
released layout, and attention every other layer) and Qwen4-Exp (qwen4exp, QSA's blocks of 2 and of 1 token:
``qwen4``), nothing downloaded; for the hybrids and MiniMax the last column
is subquad's float model against transformers' (the reference). ``--kinds a,b`` (or ``--only a b``): those models
alone; ``--converter``: also llama.cpp's own converter on tiny Qwen, LFM2-MoE, Kimi-Linear, RWKV-7, MiniMax and
Qwen4-Exp folders (``converter_rows``, ``more_converter_rows``, ``minimax_converter_rows``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

IDS = [5, 17, 30, 42, 95, 7, 12, 45, 78, 9, 11, 25]
CHILD = """
import os, sys, json
src, extra, path, ids, out = sys.argv[1:6]
os.environ["LLAMA_CPP_LIB_PATH"] = os.path.join(src, "vendor", "llama.cpp", "build", "bin")
sys.path[:0] = [src] + ([extra] if extra else [])
import numpy as np
import llama_cpp
m = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, n_threads=2, verbose=False, type_k=0, type_v=0)
ids = json.loads(ids)
m.eval(ids)
np.save(out, np.array(m.scores[:len(ids)], dtype=np.float64))
"""


QWEN = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "full_attention_interval": 2,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}}


def QWEN_MODELS(transformers):
    """Gated DeltaNet + gated attention (2 key heads for 4 value heads; K = V: llama.cpp takes the value head
    width from ssm.state_size); Qwen3-Next with experts and a shared expert in every layer (qwen3next's only
    form), Qwen3.5 dense and with experts."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 64}
    return (("qwen3_next", transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
             {**QWEN, **moe, "decoder_sparse_step": 1}),
            ("qwen3_5_text", transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {**QWEN, **MROPE}),
            ("qwen3_5_moe_text", transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
             {**QWEN, **MROPE, **moe}))


def with_mtp(folder: Path, out: Path) -> Path:
    """A copy of the Qwen3-Next folder with an MTP head under the published names (``mtp.layers.0.*``: a perturbed
    copy of attention layer 1, random fc and norms), which subquad loads as ``model.mtp``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    sd = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for k in [k for k in sd if k.startswith("model.layers.1.")]:
        sd["mtp.layers.0." + k.removeprefix("model.layers.1.")] = sd[k] + 0.05 * torch.randn(sd[k].shape, generator=g)
    d = sd["model.norm.weight"].shape[0]
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        sd[f"mtp.{n}.weight"] = 0.3 * torch.randn(d, generator=g)
    sd["mtp.fc.weight"] = 0.1 * torch.randn(d, 2 * d, generator=g)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def models(tmp: Path):
    """(kind, model): tiny random Mamba-1 (built here), Mamba-2, Falcon-Mamba, LFM2, Qwen3-Next and Qwen3.5
    (transformers' models saved and read back: the type a model was read as is the one save_gguf writes)."""
    import transformers

    from subquad.models import LanguageModel, ModelConfig, from_pretrained

    torch.manual_seed(0)
    yield "mamba", LanguageModel(ModelConfig(vocab_size=100, d_model=64, n_layers=2, pattern="mamba", mlp=False,
                                             norm_eps=1e-5)).eval(), None
    for kind, Config, Model, cfg in (
            ("mamba2", transformers.Mamba2Config, transformers.Mamba2ForCausalLM,
             {"vocab_size": 100, "hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16,
              "num_hidden_layers": 2, "conv_kernel": 4, "chunk_size": 8}),
            ("falcon_mamba", transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM,
             {"vocab_size": 100, "hidden_size": 64, "state_size": 16, "num_hidden_layers": 2, "expand": 2,
              "conv_kernel": 4, "time_step_rank": 4}),
            ("lfm2", transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
             {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 120, "block_multiple_of": 24,
              "block_ffn_dim_multiplier": 1.1, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv", "conv"],
              "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}),
            # Gated DeltaNet + gated attention (2 key heads for 4 value heads; K = V: llama.cpp takes the value
            # head width from ssm.state_size), experts with a shared expert in every layer (qwen3next's only form)
            *QWEN_MODELS(transformers)):
        torch.manual_seed(0)
        hf = Model(Config(**cfg))
        with torch.no_grad():                          # non-trivial zero-centred norms and time steps
            for name, p in hf.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.add_(0.3 * torch.randn_like(p))
        hf.save_pretrained(tmp / kind)
        yield kind, from_pretrained(tmp / kind)[0].eval(), None
        if kind == "qwen3_next":                     # with an MTP head: written as llama.cpp's nextn layer 4
            yield kind + "+mtp", from_pretrained(with_mtp(tmp / kind, tmp / (kind + "+mtp")))[0].eval(), None
    yield from ((kind, model, None) for kind, model in MORE_MODELS(tmp, transformers))
    yield from hybrids(tmp)
    yield qwen4(tmp, transformers)
    yield qwen4(tmp, transformers, "qwen4_exp_text-r1", indexer_compress_ratio=1)
    yield from minimax_models(tmp)


def minimax_models(tmp: Path):
    """(kind, subquad model, transformers model): tests/models/test_gguf_minimax.py's MiniMax - 8 layers with
    attention in the last (MiniMax-Text-01's layout, llama.cpp's default) and 4 alternating (``minimax-alternating``:
    the file states its layout, ``attention.recurrent_layers``)."""
    from subquad.models import from_pretrained
    from tests.models.test_gguf_minimax import _hf

    for kind, layout in (("minimax", "default"), ("minimax-alternating", "alternating")):
        (tmp / kind).mkdir()
        hf, folder = _hf(tmp / kind, layout)
        yield kind, from_pretrained(folder)[0].eval(), hf


# Qwen4-Exp as llama.cpp's qwen4exp holds it (tests/models/test_gguf_qwen4.py's fields): 3 hyper-connected streams,
# QSA keeping 2 blocks of 2 tokens plus the tail (binding from the 6th token of IDS on), PLE (2- and 3-grams) at the
# first layer with eos = 45, a token of IDS; the Gated DeltaNet's sigmoid output gate, K = V
QWEN4 = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "hc_count": 3, "hc_lowrank": 8,
         "layer_types": ["linear_attention", "indexed_attention"] * 2, "ple_layer_ids": [1], "ple_embed_dim": 64,
         "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 50, "make_ngram_vocab_size_divisible_by": 8,
         "split_ngram_parts": 2, "ple_conv_kernel_size": 3, "indexer_n_heads": 4, "indexer_kv_heads": 1,
         "indexer_head_dim": 16, "indexer_budget": 4, "indexer_compress_ratio": 2, "eos_token_id": 45,
         "output_gate_type": "sigmoid", "bos_token_id": None, "pad_token_id": None,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}}


def qwen4(tmp: Path, transformers, kind: str = "qwen4_exp_text", vocab: int = 100, **over):
    """(kind, subquad's load of the saved folder, transformers' model): ``QWEN4`` (with ``over``) with non-trivial
    zero-centred norms, time steps, gates and PLE convolution; the folder's config.json naming the attention layers
    "full_attention" as the released config does (llama.cpp's converter writes QSA's ratio for that name only).
    llama.cpp's QSA attends to budget + ratio - 1 tokens always (build_qsa_top_k's width): where the query's tail
    is shorter than ratio - 1, tokens of the next blocks too, which transformers' does not - ratio 1 (blocks of one
    token, no tail) is the form where both select the same tokens."""
    from subquad.models import from_pretrained

    torch.manual_seed(0)
    cfg = transformers.Qwen4ExpTextConfig(**{**QWEN4, "vocab_size": vocab, **over})
    cfg._experts_implementation = "eager"
    hf = transformers.Qwen4ExpForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "gate.weight", "ple.conv1d.weight",
                              "norm_key.weight", "norm_query.weight", "norm_conv.weight")):
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp / kind
    hf.save_pretrained(folder)
    c = json.loads((folder / "config.json").read_text())
    c["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in c["layer_types"]]
    (folder / "config.json").write_text(json.dumps(c))
    return kind, from_pretrained(folder)[0].eval(), hf


def hybrids(tmp: Path):
    """(kind, subquad model, transformers model): the hybrids of tests/models/test_gguf_hybrid.py."""
    from subquad.models import from_pretrained
    from tests.models.test_hf_falcon_h1 import _hf as falcon
    from tests.models.test_hf_granite import _hf as granite
    from tests.models.test_hf_hybrid import _hf as hybrid
    from tests.models.test_hf_nemotron_h import MOE
    from tests.models.test_hf_nemotron_h import _hf as nemotron

    for kind, make in (("granitemoehybrid", lambda p: granite(p)),
                       ("granitemoehybrid-dense", lambda p: granite(p, num_local_experts=0, intermediate_size=48)),
                       ("bamba", lambda p: hybrid(p, "bamba")), ("nemotron_h", lambda p: nemotron(p)),
                       ("nemotron_h_moe", lambda p: nemotron(p, hybrid_override_pattern="ME*EM", **MOE)),
                       ("falcon_h1", lambda p: falcon(p)), ("jamba", lambda p: hybrid(p, "jamba"))):
        (tmp / kind).mkdir()
        hf, folder = make(tmp / kind)
        yield kind, from_pretrained(folder)[0].eval(), hf


def MORE_MODELS(tmp: Path, transformers, vocab: int = 100):
    """Kimi-Linear (KDA, MLA, KDA, MLA; a dense first layer, then 8 experts of which 2 a token and a shared one,
    ungrouped routing, random router biases; saved by transformers, rewritten as the released checkpoints spell
    their config, which llama.cpp's converter reads), LFM2-MoE (conv, attention, conv, attention: a dense first
    layer, then 8 experts of which 3 a token, random expert biases; tied and unscaled, as llama.cpp's lfm2moe
    holds it) and RWKV-7 (a random BlinkDL checkpoint at
    D 128, head 64, 3 layers, read by subquad and saved as fla's Hugging Face folder; the a and v LoRAs' 16- and
    8-wide up-projections F16 in a q8_0 file, as the converter writes them)."""
    from subquad.models import from_pretrained
    from subquad.testing import random_rwkv7_pth

    torch.manual_seed(0)
    hf = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_dense_layers=1, num_experts=8, num_experts_per_tok=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
        routed_scaling_factor=1.0, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    hf.save_pretrained(tmp / "lfm2_moe")
    yield "lfm2_moe", from_pretrained(tmp / "lfm2_moe")[0].eval()
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, linear_head_dim=16,
        linear_num_heads=4, layer_types=["linear_attention", "full_attention"] * 2, pad_token_id=None,
        bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    hf.save_pretrained(tmp / "kimi_linear")
    released_kimi(tmp / "kimi_linear")
    yield "kimi_linear", from_pretrained(tmp / "kimi_linear")[0].eval()
    random_rwkv7_pth(tmp / "rwkv7.pth", vocab, 128, 3, {"w": 32, "a": 16, "v": 8, "g": 32}, 256, 64, seed=0)
    from_pretrained(tmp / "rwkv7.pth")[0].save_pretrained(tmp / "rwkv7")
    yield "rwkv7", from_pretrained(tmp / "rwkv7")[0].eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--kinds", default="", help="comma-separated model kinds (default: all)")
    ap.add_argument("--only", nargs="*", default=None, help="model kinds, space-separated (as --kinds)")
    ap.add_argument("--converter", action="store_true", help="also llama.cpp's convert_hf_to_gguf.py on tiny Qwen, "
                    "LFM2-MoE, Kimi-Linear, RWKV-7 and MiniMax folders (converter_rows, more_converter_rows, "
                    "minimax_converter_rows)")
    a = ap.parse_args(argv)
    from subquad.models import from_pretrained
    from subquad.models.gguf import save_gguf

    rows = []
    print("| model | GGUF | max abs(llama.cpp - subquad) / max abs(subquad) | next token agrees "
          "| subquad vs transformers |\n|---|---|---:|---:|---:|")
    kinds = set(filter(None, a.kinds.split(","))) | set(a.only or ())
    with tempfile.TemporaryDirectory() as tmp:
        for kind, model, hf in models(Path(tmp)):
            if kinds and kind not in kinds:
                continue
            for outtype in ("f32", "q8_0"):
                path, out = Path(tmp) / f"{kind}-{outtype}.gguf", Path(tmp) / f"{kind}-{outtype}.npy"
                save_gguf(model, path, outtype)
                subprocess.run([sys.executable, "-c", CHILD, a.llama_src, a.pythonpath, str(path), json.dumps(IDS),
                                str(out)], check=True)
                theirs = torch.from_numpy(np.load(out))
                ours = model if outtype == "f32" else from_pretrained(path)[0].eval()
                with torch.no_grad():
                    mine = ours(torch.tensor([IDS]))[0].double()
                rel = ((theirs - mine).abs().max() / mine.abs().max()).item()
                agree = (theirs.argmax(-1) == mine.argmax(-1)).double().mean().item()
                ref = "-"
                if hf is not None and outtype == "f32":
                    with torch.no_grad():
                        want = hf(torch.tensor([IDS])).logits[0].double()
                    ref = f"{((mine - want).abs().max() / want.abs().max()).item():.2e}"
                rows.append((kind, outtype, rel, agree))
                print(f"| {kind} | {outtype} | {rel:.2e} | {100 * agree:.0f}% | {ref} |", flush=True)
                if kind in ("kimi_linear", "minimax", "minimax-alternating"):   # the same, subquad given llama.cpp's
                    import copy                                                 # epsilons (llama_eps)

                    with torch.no_grad():
                        mine = llama_eps(copy.deepcopy(ours))(torch.tensor([IDS]))[0].double()
                    rel = ((theirs - mine).abs().max() / mine.abs().max()).item()
                    agree = (theirs.argmax(-1) == mine.argmax(-1)).double().mean().item()
                    print(f"| {kind}, subquad with llama.cpp's epsilons | {outtype} | {rel:.2e} | "
                          f"{100 * agree:.0f}% | - |", flush=True)
    if a.converter:
        converter_rows(a)
        more_converter_rows(a)
        minimax_converter_rows(a)
        qwen4_converter_rows(a)


# llama.cpp's own converter on a tiny folder: its BPE pre-tokenizer check hashes a known tokenizer's output (a
# tokenizer trained here has none, and nothing is downloaded), so that one step is answered "default"; every
# tensor and metadata key is the converter's own
CONVERT = """
import sys
src, folder, out, outtype, *flags = sys.argv[1:]
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype, *flags]
convert_hf_to_gguf.main()
"""


def convert_and_compare(a, folder: Path, path: Path, outtype: str, saved, reference, tmp: Path, *convert_args):
    """One converter row's work: llama.cpp's converter on ``folder`` -> ``path``; subquad's load of it (``ours``)
    and its logits (``mine``) against ``reference(ids)``'s; save_gguf's file of ``saved`` against the converter's;
    llama.cpp's logits of the converter's file (``theirs``) -> (ours, mine, vs_reference, same, theirs)."""
    from subquad.models import from_pretrained
    from subquad.models.gguf import save_gguf
    from subquad.models.gguf.reader import GGUFFile

    llama = Path(a.llama_src) / "vendor" / "llama.cpp"
    subprocess.run([sys.executable, "-c", CONVERT, str(llama), str(folder), str(path), outtype, *convert_args],
                   check=True, capture_output=True)
    ours = from_pretrained(path)[0].eval()
    ids = torch.tensor([IDS])
    with torch.no_grad():
        want, mine = reference(ids)[0].double(), ours(ids)[0].double()
    vs_reference = ((mine - want).abs().max() / want.abs().max()).item()
    save_gguf(saved, tmp / "ours.gguf", outtype)
    same = same_file(GGUFFile(tmp / "ours.gguf"), GGUFFile(path))
    out = tmp / "llama.npy"
    subprocess.run([sys.executable, "-c", CHILD, a.llama_src, a.pythonpath, str(path), json.dumps(IDS), str(out)],
                   check=True)
    return ours, mine, vs_reference, same, torch.from_numpy(np.load(out))


def print_row(label: str, outtype: str, reference: str, same: str, theirs, mine) -> None:
    """A converter table's row: llama.cpp's logits against subquad's, and how often their next tokens agree."""
    rel = ((theirs - mine).abs().max() / mine.abs().max()).item()
    agree = (theirs.argmax(-1) == mine.argmax(-1)).double().mean().item()
    print(f"| {label} | {outtype} | {reference} | {same} | {rel:.2e} | {100 * agree:.0f}% |", flush=True)


def converter_rows(a):
    """Tiny Qwen3-Next / Qwen3.5 folders (with a byte-level BPE tokenizer: the converter reads one) converted by
    llama.cpp's ``convert_hf_to_gguf.py``: subquad's load of the file against transformers, save_gguf's file of
    the folder against the converter's (tensor names, shapes, types, F32 values, metadata keys), llama.cpp on
    the converter's file against subquad's load of it."""
    import transformers

    from subquad.data.tokenizer import train_tokenizer
    from subquad.models import from_pretrained

    tok = train_tokenizer(["".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200))], vocab_size=320)
    print("\n| model | converter's GGUF | subquad vs transformers | save_gguf = converter's file | llama.cpp vs "
          "subquad | next token agrees |\n|---|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind, Config, Model, cfg in QWEN_MODELS(transformers):
            if a.only and kind not in a.only:
                continue
            torch.manual_seed(0)
            hf = Model(Config(**{**cfg, "vocab_size": 320})).eval()
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if name.endswith(("norm.weight", "dt_bias")):
                        p.add_(0.3 * torch.randn_like(p))
            folder = tmp / kind
            hf.save_pretrained(folder)
            transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
            saved = from_pretrained(folder)[0]
            for outtype in ("f32", "q8_0"):
                _, mine, vs_hf, same, theirs = convert_and_compare(
                    a, folder, tmp / f"{kind}-{outtype}.gguf", outtype, saved, lambda ids: hf(ids).logits, tmp,
                    "--no-mtp")
                print_row(kind, outtype, f"{vs_hf:.2e}", same, theirs, mine)


def llama_eps(model):
    """A Kimi-Linear or MiniMax model given llama.cpp's epsilons: its kimi-linear graph L2-normalises KDA's q and k
    and RMS-normalises MLA's latents with ``attention.layer_norm_rms_epsilon`` (1e-5 here), where transformers and
    fla use 1e-6 (fla's L2 norm, KimiLinearRMSNorm's default); its minimax-01 graph norms the lightning layers'
    output with it too (``attn_norm_2``), transformers' MiniMaxRMSNorm there its default 1e-6 - the whole of the two
    engines' f32 difference."""
    from subquad.layers.lightning import LightningAttention

    eps = model.config.norm_eps
    for block in model.blocks:
        if isinstance(block.mixer, LightningAttention):
            block.mixer.norm.eps = eps
        if hasattr(block.mixer, "qk_eps"):
            block.mixer.qk_eps = eps
        for name in ("kv_a_norm", "q_a_norm"):
            if getattr(block.mixer, name, None) is not None:
                getattr(block.mixer, name).eps = eps
    return model


def released_kimi(folder: Path) -> None:
    """The transformers-saved Kimi-Linear folder rewritten as the released checkpoints spell it, which llama.cpp's
    converter reads (``linear_attn_config``, ``first_k_dense_replace``, ``moe_router_activation_func``,
    ``num_key_value_heads`` = the heads, dense MLPs under ``mlp.``); subquad reads both spellings."""
    from safetensors.torch import load_file, save_file

    c = json.loads((folder / "config.json").read_text())
    types, mlp = c.pop("layer_types"), c.pop("mlp_layer_types")
    dense = mlp.count("dense")
    c["linear_attn_config"] = {"full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
                               "kda_layers": [i + 1 for i, t in enumerate(types) if t != "full_attention"],
                               "num_heads": c.pop("linear_num_heads"), "head_dim": c.pop("linear_head_dim"),
                               "short_conv_kernel_size": c.pop("linear_conv_kernel_dim")}
    c.update(first_k_dense_replace=dense, moe_router_activation_func="sigmoid",
             num_key_value_heads=c["num_attention_heads"])
    c.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(c, indent=1))
    sd = load_file(str(folder / "model.safetensors"))
    sd = {(k.replace(".block_sparse_moe.", ".mlp.") if k.startswith("model.layers.") and int(k.split(".")[2]) < dense
           else k): v for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def more_converter_rows(a):
    """``converter_rows`` for LFM2-MoE and RWKV-7 (``MORE_MODELS``' models, LFM2-MoE's with a byte-level BPE
    tokenizer, RWKV-7's fla folder with a 60-token RWKV world vocabulary file, which its converter reads): subquad's
    load of the converter's file against the folder's reference (transformers; for RWKV-7 subquad's load of the
    folder), save_gguf's file against the converter's, llama.cpp on the converter's file against subquad."""
    import transformers

    from subquad.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200))], vocab_size=320)
    print("\n| model | converter's GGUF | subquad vs reference | save_gguf = converter's file | llama.cpp vs "
          "subquad | next token agrees |\n|---|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind, model in MORE_MODELS(tmp, transformers, vocab=320):
            if a.only and kind not in a.only:
                continue
            folder = tmp / kind
            if kind in ("lfm2_moe", "kimi_linear"):
                transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
                ref = None if kind == "kimi_linear" else transformers.Lfm2MoeForCausalLM.from_pretrained(folder).eval()
            else:                                   # RWKV's world vocabulary: "id repr(token) length" a line
                (folder / "rwkv_vocab_v20230424.txt").write_text(
                    "".join(f"{i} {chr(64 + i)!r} 1\n" for i in range(1, 61)), encoding="utf-8")
                ref = None
            reference = (lambda ids: ref(ids).logits) if ref is not None else model
            for outtype in ("f32", "q8_0"):
                ours, mine, vs_ref, same, theirs = convert_and_compare(
                    a, folder, tmp / f"{kind}-{outtype}.gguf", outtype, model, reference, tmp)
                print_row(kind, outtype, f"{vs_ref:.2e}", same, theirs, mine)
                if kind == "kimi_linear":
                    import copy

                    with torch.no_grad():
                        mine = llama_eps(copy.deepcopy(ours))(torch.tensor([IDS]))[0].double()
                    print_row(f"{kind}, subquad with llama.cpp's epsilons", outtype, "", "", theirs, mine)


def minimax_converter_rows(a):
    """``converter_rows`` for MiniMax (``minimax_models``' default layout, with a byte-level BPE tokenizer): the
    transformers folder rewritten as the released checkpoint spells it (``gguf_minimax_harness.released_folder``:
    the converter reads ``layernorm_*_alpha``, ``rotary_dim``, no lightning buffers); subquad's load of the
    converter's file against transformers, save_gguf's file against the converter's, llama.cpp on the converter's
    file against subquad (and against subquad with llama.cpp's epsilons)."""
    import copy

    import transformers

    from subquad.data.tokenizer import train_tokenizer
    from subquad.models import from_pretrained
    from tests.models.gguf_minimax_harness import released_folder
    from tests.models.test_gguf_minimax import _hf

    if a.only and "minimax" not in a.only:
        return
    tok = train_tokenizer(["".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200))], vocab_size=320)
    print("\n| model | converter's GGUF | subquad vs transformers | save_gguf = converter's file | llama.cpp vs "
          "subquad | next token agrees |\n|---|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf, folder = _hf(tmp, "default", vocab_size=320)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
        model = from_pretrained(folder)[0].eval()
        released = released_folder(folder, tmp / "released")
        for outtype in ("f32", "q8_0"):
            ours, mine, vs_hf, same, theirs = convert_and_compare(
                a, released, tmp / f"minimax-{outtype}.gguf", outtype, model, lambda ids: hf(ids).logits, tmp)
            with torch.no_grad():
                mine_eps = llama_eps(copy.deepcopy(ours))(torch.tensor([IDS]))[0].double()
            print_row("minimax", outtype, f"{vs_hf:.2e}", same, theirs, mine)
            print_row("minimax, subquad with llama.cpp's epsilons", outtype, "", "", theirs, mine_eps)


def qwen4_converter_rows(a):
    """``converter_rows`` for Qwen4-Exp (``qwen4``'s folders, QSA blocks of 2 and of 1, with a byte-level BPE
    tokenizer): subquad's load of the converter's file against transformers, save_gguf's file against the
    converter's, llama.cpp on the converter's file against subquad."""
    import transformers

    from subquad.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200))], vocab_size=320)
    print("\n| model | converter's GGUF | subquad vs transformers | save_gguf = converter's file | llama.cpp vs "
          "subquad | next token agrees |\n|---|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind, over in (("qwen4_exp_text", {}), ("qwen4_exp_text-r1", {"indexer_compress_ratio": 1})):
            if a.only and kind not in a.only:
                continue
            _, model, hf = qwen4(tmp, transformers, kind, vocab=320, **over)
            folder = tmp / kind
            transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
            for outtype in ("f32", "q8_0"):
                _, mine, vs_hf, same, theirs = convert_and_compare(
                    a, folder, tmp / f"{kind}-{outtype}.gguf", outtype, model, lambda ids: hf(ids).logits, tmp)
                print_row(kind, outtype, f"{vs_hf:.2e}", same, theirs, mine)


def same_file(ours, theirs) -> str:
    """"yes", or what differs: tensor names, shapes, types, F32 values (to 2e-6), the architecture's metadata keys
    and values (the file type and vocabulary aside)."""
    if set(ours.tensors) != set(theirs.tensors):
        return f"no: tensors {sorted(set(ours.tensors) ^ set(theirs.tensors))[:4]}"
    for g, t in ours.tensors.items():
        u = theirs.tensors[g]
        if (t.type, tuple(t.shape)) != (u.type, tuple(u.shape)):
            return f"no: {g} {t.type} {tuple(t.shape)} / {u.type} {tuple(u.shape)}"
        if t.type == "F32" and not torch.allclose(ours.plain(g), theirs.plain(g), rtol=0, atol=2e-6):
            return f"no: {g} values"
        if t.type != "F32" and not torch.equal(ours.raw(g), theirs.raw(g)):
            return f"no: {g} bytes"
    arch = ours.metadata["general.architecture"]
    mine = {k: v for k, v in ours.metadata.items() if k.startswith(arch + ".") and k != f"{arch}.vocab_size"}
    conv = {k: v for k, v in theirs.metadata.items() if k.startswith(arch + ".") and k != f"{arch}.vocab_size"}
    if mine.keys() != conv.keys():
        return f"no: keys {sorted(set(mine) ^ set(conv))}"
    differ = [k for k in mine if not (mine[k] == conv[k] or np.allclose(mine[k], conv[k], rtol=1e-7))]
    return "yes" if not differ else f"no: {', '.join(f'{k}={mine[k]}/{conv[k]}' for k in differ)}"


if __name__ == "__main__":
    main()
