"""Does llama.cpp's GGUF of a benchmark folder compute the same model? Logits at every position of a short
prompt from llama-cpp-python against transformers' on the folder (float32 GGUF).

    python benchmarks/llama_parity.py --llama-python /tmp/llvenv/bin/python --llama-src LLAMA_SRC \\
        --models lfm2,falcon_h1,qwen3_5,nemotron_h,granitemoehybrid

Each folder is bench_pretrained's ``--quick`` model of the kind (random weights, tiny shapes), converted
by ``llama_convert.py``. Prints the largest difference relative to the logits' scale and how often the
two agree on the next token.
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_pretrained import hf_model  # noqa: E402

IDS = [5, 17, 300, 42, 999, 7, 123, 456, 78, 9, 11, 250]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", required=True)
    p.add_argument("--llama-src", required=True)
    p.add_argument("--models", default="lfm2,falcon_h1,qwen3_5,nemotron_h,granitemoehybrid")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            hf = hf_model(kind, quick=True).eval()
            folder, gguf = Path(tmp) / kind, Path(tmp) / f"{kind}.gguf"
            hf.save_pretrained(folder)
            conv = subprocess.run([sys.executable, str(Path(__file__).parent / "llama_convert.py"), args.llama_src,
                                   str(folder), "--outfile", str(gguf), "--outtype", "f32"], capture_output=True, text=True)
            if conv.returncode:
                print(f"{kind}: the converter refused: {conv.stderr.strip().splitlines()[-1]}")
                continue
            code = (f"import json, numpy as np\nfrom llama_cpp import Llama\n"
                    f"llm = Llama(model_path={str(gguf)!r}, n_ctx=64, n_threads=1, logits_all=True, verbose=False)\n"
                    f"llm.eval({IDS})\nprint(json.dumps(np.asarray(llm.scores[:{len(IDS)}]).tolist()))")
            out = subprocess.run([args.llama_python, "-c", code], capture_output=True, text=True)
            if out.returncode:
                print(f"{kind}: llama.cpp refused: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
                continue
            ll = np.array(json.loads(out.stdout.strip().splitlines()[-1]))
            with torch.no_grad():
                ref = hf(torch.tensor([IDS])).logits[0].float().numpy()
            err = np.abs(ll - ref).max() / np.abs(ref).max()
            print(f"{kind}: llama.cpp against transformers over {len(IDS)} positions: max difference {err:.1e} of "
                  f"the logits' scale, next token agrees at {(ll.argmax(-1) == ref.argmax(-1)).mean():.0%}")


if __name__ == "__main__":
    main()
