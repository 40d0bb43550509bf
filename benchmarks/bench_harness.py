"""lm-evaluation-harness throughput on a multiple-choice task: ``--model subquad`` (a shared context read once,
``subquad.harness``) against lm_eval's own ``hf`` backend, on the same folder: a random transformers Mamba at
mamba-130m's shape (d_model 768, 24 layers, vocab 50,280), nothing downloaded.

The task: --docs questions of --context tokens, each with 4 choices of 1-8 tokens (words of a generated
word-level tokenizer): the 4 x --docs loglikelihood requests lm_eval's ``multiple_choice`` makes, handed to
each backend's ``loglikelihood`` (the harness's own task loading, the same for both, is left out). Reports
requests/s of each, their ratio, and whether they pick the same choices.

    python benchmarks/bench_harness.py                 # 32 questions of 256 tokens, 2 threads
    python benchmarks/bench_harness.py --quick         # tiny model, seconds
Writes results/NAME.{json,md} (default harness).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, machine_line  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def make_folder(root: Path, quick: bool, vocab: int) -> Path:
    """A random transformers Mamba at mamba-130m's shape (tiny with ``quick``) and a word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    d, n = (64, 2) if quick else (768, 24)
    cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=d, state_size=16, num_hidden_layers=n, expand=2,
                                   conv_kernel=4)
    folder = root / "model"
    transformers.MambaForCausalLM(cfg).eval().save_pretrained(folder)
    words = {f"w{i:05d}": i for i in range(vocab)}                      # one length: no word begins another
    tok = Tokenizer(models.WordLevel(words, unk_token="w00000"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["w00000", "w00001"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "eos_token": "w00001", "pad_token": "w00000"}))
    return folder


def make_requests(docs: int, context: int, vocab: int):
    """lm_eval's loglikelihood requests of a 4-way multiple-choice task (as ``multiple_choice`` builds them:
    the question, then " " + each choice), and the answers."""
    from lm_eval.api.instance import Instance

    g = torch.Generator().manual_seed(1)

    def words(k):
        return " ".join(f"w{i:05d}" for i in torch.randint(2, vocab, (k,), generator=g).tolist())

    reqs = []
    for d in range(docs):
        q = words(context)
        for c in range(4):
            reqs.append(Instance("loglikelihood", {}, (q, " " + words(int(torch.randint(1, 9, (1,), generator=g)))), c))
    return reqs


def timed(lm, reqs):
    """(seconds, the choice each question's loglikelihoods pick)."""
    t = time.perf_counter()
    out = lm.loglikelihood(reqs)
    dt = time.perf_counter() - t
    lls = [ll for ll, _ in out]
    return dt, [max(range(4), key=lambda c: lls[4 * d + c]) for d in range(len(lls) // 4)], lls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--name", default="harness")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.quick:
        a.docs, a.context = 4, 16
    from subquad.harness import SubquadLM

    from lm_eval.models.huggingface import HFLM

    vocab = 512 if a.quick else 50280
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), a.quick, vocab)
        reqs = make_requests(a.docs, a.context, vocab)
        machine = machine_line()
        print(machine, flush=True)
        ours_lm = SubquadLM(path=str(folder), batch_size=a.batch_size)
        hf_lm = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=a.batch_size)
        timed(ours_lm, reqs[:8]), timed(hf_lm, reqs[:8])                  # warm-up
        ours_lm.context_prefills = 0
        t_ours, pick_ours, ll_ours = timed(ours_lm, reqs)
        print(f"subquad: {t_ours:.1f} s", flush=True)
        t_hf, pick_hf, ll_hf = timed(hf_lm, reqs)
        print(f"hf: {t_hf:.1f} s", flush=True)
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(ll_ours, ll_hf))
    n = 4 * a.docs
    row = {"docs": a.docs, "context": a.context, "requests": n, "subquad_s": t_ours, "hf_s": t_hf,
           "subquad_req_s": n / t_ours, "hf_req_s": n / t_hf, "speedup": t_hf / t_ours,
           "contexts_read": ours_lm.context_prefills, "same_choices": pick_ours == pick_hf,
           "max_rel_diff": worst, "machine": machine}
    md = [f"lm_eval multiple choice, {a.docs} questions of {a.context} tokens x 4 choices, "
          f"{'tiny model' if a.quick else 'mamba-130m shape'}, batch {a.batch_size}; {machine}", "",
          "| backend | seconds | requests/s | contexts read |", "|---|---|---|---|",
          f"| subquad (shared context read once) | {t_ours:.1f} | {n / t_ours:.2f} | {ours_lm.context_prefills} |",
          f"| lm_eval hf | {t_hf:.1f} | {n / t_hf:.2f} | {n} |", "",
          f"speed-up {t_hf / t_ours:.2f}x (target >= 2x: {'met' if t_hf / t_ours >= 2 else 'missed'}); "
          f"same choice picked for every question: {pick_ours == pick_hf}; loglikelihoods within {worst:.1e} relative"]
    print("\n".join(md))
    OUT.mkdir(exist_ok=True)
    (OUT / f"{a.name}.json").write_text(json.dumps(row, indent=1))
    (OUT / f"{a.name}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
