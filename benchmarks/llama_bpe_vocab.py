"""Byte-level BPE vocabularies in GGUF against llama.cpp: for each pre-tokenizer family (Qwen2's single digits,
Llama 3's digits in threes with merges ignored for whole tokens, StarCoder's digits then GPT-2's, GPT-2's own), a
tiny BPE is trained with ``tokenizers`` in the form released tokenizer.json files hold it, a tiny Mamba is written by
``save_gguf`` with it (``tokenizer.ggml.pre`` named by ``gguf.pretok``), and llama.cpp's own ``llama-server``
tokenizes a few texts (``/tokenize``) on the file: its ids against the tokenizer's.

    python benchmarks/llama_bpe_vocab.py --llama-server LLAMA_SRC/build/bin/llama-server

(``LLAMA_SRC``: llama.cpp's source as vendored in llama-cpp-python, built natively - README, "GGUF files".)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from subquad.models.gguf import pretok  # noqa: E402

FAMILIES = {"qwen2": ([pretok.QWEN2], False, False), "llama-bpe": ([pretok.LLAMA3], False, True),
            "starcoder": (["digits"], True, False), "gpt-2": ([], True, False)}   # regexes, GPT-2's after, ignore
TRAIN = [f"In 20{i:02d}, hello!!! world's {i * 12345} (x+y)  中文 café\n\n  ok it'S" for i in range(40)]
TEXTS = ["In 2031, hello!!! world's 987654321 (a+b)  中 café\n\n\n ok It'S", *TRAIN[:3],
         "def f(x):\n    return x*1000  # 12", "   ", "a"]


def tokenizer(regexes, gpt2_regex, ignore):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore))
    splits = [pre_tokenizers.Digits(individual_digits=True) if r == "digits" else
              pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=gpt2_regex)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=400,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def llama_tokenize(server, path, texts, port):
    """llama-server's /tokenize of each text on the file (the server on 127.0.0.1, stopped after)."""
    p = subprocess.Popen([server, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "256"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):                                         # at most ~60 s to start
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if p.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({p.returncode}) on {path}") from None
                time.sleep(0.3)
        out = []
        for t in texts:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=json.dumps({"content": t}).encode(),
                                         headers={"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(req, timeout=30).read())["tokens"])
        return out
    finally:
        p.terminate()
        p.wait(timeout=30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--port", type=int, default=8931)
    args = ap.parse_args(argv)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.gguf import save_gguf
    from subquad.models.gguf.reader import GGUFFile

    print("| family | tokenizer.ggml.pre written | texts where llama.cpp's ids equal the tokenizer's |")
    print("|---|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (family, spec) in enumerate(FAMILIES.items()):
            tok = tokenizer(*spec)
            model = LanguageModel(ModelConfig(vocab_size=416, d_model=64, n_layers=2, n_heads=2, pattern="mamba",
                                              mlp=False)).eval()
            path = Path(tmp) / f"{family}.gguf"
            save_gguf(model, path, "f32", tokenizer=tok)
            pre = GGUFFile(path).metadata.get("tokenizer.ggml.pre")
            theirs = llama_tokenize(args.llama_server, path, TEXTS, args.port + i)
            same = sum(a == tok.encode(t).ids for a, t in zip(theirs, TEXTS))
            print(f"| {family} | {pre} | {same} of {len(TEXTS)} |", flush=True)


if __name__ == "__main__":
    main()
