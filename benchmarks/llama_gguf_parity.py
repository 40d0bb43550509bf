"""Does llama.cpp compute the same model from the GGUF files subquad writes (``save_gguf``)? Logits at every
position of a short prompt from llama.cpp (llama-cpp-python's bindings over a natively built ``libllama``)
against subquad's: float32 files against the float model, q8_0 files against subquad's own load of the same
file (``from_pretrained("x.gguf")``: Q8_0 kept as per-block int8).

    python benchmarks/llama_gguf_parity.py --llama-src LLAMA_PY_SRC [--pythonpath DIR]

LLAMA_PY_SRC: an unpacked llama-cpp-python sdist whose ``vendor/llama.cpp/build/bin`` holds the built libraries
(see RESULTS.md "Decoding against llama.cpp" for the build); ``--pythonpath``: where its Python dependencies
(diskcache) are, if not installed; ``--kinds``: only these models. Tiny random Mamba-1, Mamba-2, Falcon-Mamba,
LFM2 and the hybrids (Granite 4 with experts and multipliers, Granite 4 dense, Bamba, Nemotron-H with and
without experts, Falcon-H1 with its muP multipliers, Jamba: the parity tests' models), nothing downloaded. For
the hybrids the last column is subquad's float model against transformers' (the reference).
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


def models(tmp: Path):
    """(kind, model): tiny random Mamba-1 (built here), Mamba-2, Falcon-Mamba and LFM2 (transformers' models saved
    and read back: the type a model was read as is the one save_gguf writes)."""
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
              "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None})):
        torch.manual_seed(0)
        Model(Config(**cfg)).save_pretrained(tmp / kind)
        yield kind, from_pretrained(tmp / kind)[0].eval(), None
    yield from hybrids(tmp)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--kinds", default="", help="comma-separated model kinds (default: all)")
    a = ap.parse_args(argv)
    from subquad.models import from_pretrained
    from subquad.models.gguf import save_gguf

    rows = []
    print("| model | GGUF | max abs(llama.cpp - subquad) / max abs(subquad) | next token agrees "
          "| subquad vs transformers |\n|---|---|---:|---:|---:|")
    kinds = set(filter(None, a.kinds.split(",")))
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


if __name__ == "__main__":
    main()
