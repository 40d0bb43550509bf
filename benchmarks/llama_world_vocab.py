"""RWKV's world vocabulary in GGUF against llama.cpp: a tiny random RWKV-7 (vocab 65,536, as released) in fla's
layout with BlinkDL's ``rwkv_vocab_v20230424.txt`` beside it is converted by llama.cpp's own
``convert_hf_to_gguf.py``; ``save_gguf`` writes the same model with subquad's world tokenizer. Compared: the two
files' ``tokenizer.*`` metadata, and llama.cpp's tokenization (``llama_tokenize``, llama-cpp-python's bindings over
a natively built libllama) of a few strings on the converter's file against subquad's (``from_pretrained`` of the
same file) and against the ``rwkv`` package's ``TRIE_TOKENIZER``, then llama.cpp's detokenization of those ids.

    python benchmarks/llama_world_vocab.py --llama-src LLAMA_PY_SRC [--pythonpath DIR]

(``LLAMA_PY_SRC`` and ``--pythonpath`` as in ``llama_gguf_parity.py``.) Needs the ``rwkv`` package (its vocabulary
file and tokenizer) and the converter's Python dependencies.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXTS = ["Hello, world! The quick brown fox.", "def f(x):\n    return x ** 2\n\n\t}",
         "中文分词测试：这是一个句子。日本語、한국어 문장.", "emoji 🙂🚀 café naïve Ωμέγα",
         "\x01 control \x7f bytes \\ back\\slash 'single' \"double\" \\x41 \\n", "   ", "a",
         "User: hi\n\nAssistant:", "<s>User: hi", "[PAD65530] is text"]
CHILD = """
import os, sys, json
src, extra, path, texts = sys.argv[1:5]
os.environ["LLAMA_CPP_LIB_PATH"] = os.path.join(src, "vendor", "llama.cpp", "build", "bin")
sys.path[:0] = [src] + ([extra] if extra else [])
import llama_cpp
m = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
out = []
for t in json.loads(texts):
    plain = m.tokenize(t.encode(), add_bos=False, special=False)
    special = m.tokenize(t.encode(), add_bos=False, special=True)
    out.append([plain, special, m.detokenize(plain).decode("utf-8", "replace")])
print(json.dumps({"out": out, "eog": [i for i in range(m.n_vocab()) if llama_cpp.llama_vocab_is_eog(
    llama_cpp.llama_model_get_vocab(m.model), i)]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--pythonpath", default="")
    a = ap.parse_args()
    import rwkv.rwkv_tokenizer as rwkv_tokenizer

    from benchmarks.llama_gguf_parity import CONVERT
    from subquad.data.rwkv_world import VOCAB_FILE
    from subquad.models import from_pretrained
    from subquad.models.gguf import save_gguf
    from subquad.models.gguf.reader import GGUFFile
    from subquad.testing import random_rwkv7_pth

    vocab = Path(rwkv_tokenizer.__file__).parent / VOCAB_FILE
    ref = rwkv_tokenizer.TRIE_TOKENIZER(str(vocab))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        random_rwkv7_pth(tmp / "model.pth", 65536, 64, 1, {"w": 32, "a": 32, "v": 32, "g": 32}, 128)
        shutil.copy(vocab, tmp / VOCAB_FILE)
        model, tok = from_pretrained(tmp / "model.pth")
        model.save_pretrained(tmp / "fla")
        shutil.copy(vocab, tmp / "fla" / VOCAB_FILE)
        theirs = tmp / "theirs.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, str(Path(a.llama_src) / "vendor" / "llama.cpp"),
                        str(tmp / "fla"), str(theirs), "f32"], check=True, capture_output=True)
        save_gguf(model, tmp / "ours.gguf", tokenizer=tok)
        x, y = GGUFFile(tmp / "ours.gguf").metadata, GGUFFile(theirs).metadata
        keys = sorted({k for k in {*x, *y} if k.startswith("tokenizer.")})
        print("| tokenizer.* key | save_gguf = converter's |\n|---|---|")
        for k in keys:
            same = "yes" if x.get(k) == y.get(k) else f"no: {str(x.get(k))[:40]!r} / {str(y.get(k))[:40]!r}"
            print(f"| {k} | {same} |")
        loaded, ours = from_pretrained(theirs)
        got = json.loads(subprocess.run([sys.executable, "-c", CHILD, a.llama_src, a.pythonpath, str(theirs),
                                         json.dumps(TEXTS)], check=True, capture_output=True, text=True).stdout)
        print(f"\nllama.cpp's end-of-generation ids: {got['eog']}; subquad's: {loaded.config.eos_token_ids}")
        print("\n| text | tokens | subquad = llama.cpp (special=False) | = llama.cpp (special=True) | = rwkv package | "
              "llama.cpp detokenizes to the text |\n|---|---:|---|---|---|---|")
        for text, (plain, special, back) in zip(TEXTS, got["out"], strict=True):
            ids = ours.encode(text).ids
            print(f"| {text[:24]!r} | {len(ids)} | {ids == plain} | {ids == special} | {ids == ref.encode(text)} | "
                  f"{back == text} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
