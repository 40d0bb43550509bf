"""Quantised weights on real text: for every checkpoint type, a small model of that type's structure trained on
the embedded stdlib corpus, saved as a Hugging Face folder and loaded back in float32 and quantised; and a
subquad run loaded with ``load_run(..., quantize=...)``.

Per row: held-out loss (nats/token) of float32, int8, int4 (groups of ``--int4-group``) and bf16 over the trainer's
fixed held-out windows (a prefill: int8 with AMX tiles or AVX-512 VNNI rounds each row of x to 8 bits there, int4
with VNNI per block of 32 - ``models.quant``'s module doc; elsewhere the products multiply by the dequantised
weights), the loss token by token through the decoding step (activations rounded per step) over 256 held-out
tokens, and greedy
agreement over 256 tokens from a held-out prompt (tokens equal to float32's before the first difference,
and in all). Every projection is quantised here (``min_weights=0``), the head included - stricter than the
default, which keeps matrices under ``MIN_WEIGHTS`` in float32.

    python benchmarks/bench_quant_accuracy.py                 # ~10 minutes on 2 cores
    python benchmarks/bench_quant_accuracy.py --kinds mamba --steps 50 --quick
Writes results/quant_accuracy.{json,md} (``_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, machine_line  # noqa: E402

KINDS = ["mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "qwen3_next", "olmo_hybrid", "kimi_linear", "minimax"]
VOCAB = 1024
CONTEXT = 128


def structure(kind, tmp):
    """A ModelConfig of checkpoint type ``kind``: the parity tests' tiny transformers config, at VOCAB tokens."""
    import transformers  # noqa: F401  (the builders need it)

    from subquad.models.hf import MAPPINGS
    from tests.models import test_hf, test_hf_delta, test_hf_hybrid, test_hf_kimi, test_hf_minimax

    if kind in test_hf.KINDS:
        folder = test_hf._hf_mamba(tmp, falcon=kind)[1]
    elif kind in test_hf_hybrid.KINDS:
        folder = test_hf_hybrid._hf(tmp, kind)[1]
    elif kind in test_hf_delta.KINDS:
        folder = test_hf_delta._hf(tmp, kind)[1]
    elif kind == "kimi_linear":
        folder = test_hf_kimi._hf(tmp)[1]
    else:
        folder = test_hf_minimax._hf(tmp)[1]
    c = json.loads((folder / "config.json").read_text())
    c["vocab_size"] = VOCAB
    cfg = MAPPINGS[kind].config(c)
    cfg.context_length = CONTEXT
    return cfg


def decode_loss(model, ids):
    """Mean next-token loss of ids (1, T) fed one token at a time through ``model.step``."""
    with torch.no_grad():
        logits, state = model.prefill(ids[:, :1])
        total, last = 0.0, logits[:, -1]
        for t in range(1, ids.shape[1]):
            total += F.cross_entropy(last.float(), ids[:, t]).item()
            last, state = model.step(ids[:, t], state)
    return total / (ids.shape[1] - 1)


def agreement(a, b):
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return first, sum(x == y for x, y in zip(a, b))


INT4_GROUP = 32             # these models' widths (32-64) are multiples of 32, not of 128


def measure(name, model, td, n=256):
    from subquad.models.quant import quantize
    from subquad.train import evaluate

    model.eval()
    held = torch.as_tensor(td.heldout[: n + 1], dtype=torch.long).view(1, -1)
    prompt = td.heldout[1000:1032].tolist()
    row = {"model": name}
    greedy = {}
    for kind in ("float32", "int8", "int4", "bf16"):
        m = model if kind == "float32" else quantize(copy.deepcopy(model), kind, min_weights=0, group_size=INT4_GROUP)
        row[kind] = {"heldout": evaluate(m, td.heldout, CONTEXT, 8, 8),
                     "decode": decode_loss(m, held)}
        greedy[kind] = m.generate(prompt, n, temperature=0)[0]
    for kind in ("int8", "int4", "bf16"):
        row[kind]["heldout_rel"] = row[kind]["heldout"] / row["float32"]["heldout"] - 1
        row[kind]["ppl_rel"] = math.exp(row[kind]["heldout"] - row["float32"]["heldout"]) - 1
        row[kind]["decode_rel"] = row[kind]["decode"] / row["float32"]["decode"] - 1
        row[kind]["decode_ppl_rel"] = math.exp(row[kind]["decode"] - row["float32"]["decode"]) - 1
        row[kind]["greedy_first_diff"], row[kind]["greedy_equal"] = agreement(greedy[kind], greedy["float32"])
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=300, help="training steps per model")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--int4-group", type=int, default=INT4_GROUP)
    args = p.parse_args(argv)
    globals()["INT4_GROUP"] = args.int4_group
    torch.set_num_threads(2)
    from subquad.data import prepare
    from subquad.models import LanguageModel, ModelConfig, from_pretrained
    from subquad.train import TrainConfig, Trainer, load_run

    machine = machine_line()
    print(machine, flush=True)
    td = prepare(None, VOCAB, log=lambda m: None)
    rows = []
    tcfg = TrainConfig(steps=args.steps, batch_size=8, eval_every=args.steps, ckpt_every=args.steps, warmup=20)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind in args.kinds.split(","):
            torch.manual_seed(0)
            model = LanguageModel(structure(kind, tmp / f"{kind}-hf"))
            Trainer(model, td, tcfg, tmp / f"{kind}-run", progress=False).fit(log=lambda m: None)
            model.save_pretrained(tmp / kind)
            loaded, _ = from_pretrained(tmp / kind)
            rows.append(measure(kind, loaded, td))
        cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=4, n_heads=2, context_length=128,
                          pattern="mamba2*3,softmax")
        Trainer(LanguageModel(cfg), td, tcfg, tmp / "run", progress=False).fit(log=lambda m: None)
        model, _, _ = load_run(tmp / "run")
        rows.append(measure("subquad run (mamba2*3,softmax)", model, td))
    md = [f"{machine}. Models of each checkpoint type's structure (the parity tests' shapes, vocabulary {VOCAB}) "
          f"trained {args.steps} steps on the stdlib corpus, saved and loaded back; every projection quantised "
          "(min_weights=0). held-out: the trainer's 8 x 8 windows of 128 (prefill); decode: 256 held-out "
          "tokens one step at a time; greedy: 256 tokens from a held-out prompt, equal to float32's before the "
          "first difference / in all.", "",
          "| model | float32 held-out loss | int8 | loss | perplexity | bf16 | perplexity | float32 decode loss | "
          "int8 | perplexity | greedy int8: first diff, equal | greedy bf16 | int4 held-out perplexity | "
          "int4 decode perplexity | greedy int4 |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        f, i, b, q = r["float32"], r["int8"], r["bf16"], r["int4"]
        md.append(f"| {r['model']} | {f['heldout']:.4f} | {i['heldout']:.4f} | {100 * i['heldout_rel']:+.2f}% | "
                  f"{100 * i['ppl_rel']:+.2f}% | {b['heldout']:.4f} | {100 * b['ppl_rel']:+.2f}% | {f['decode']:.4f} | "
                  f"{i['decode']:.4f} | {100 * i['decode_ppl_rel']:+.2f}% | {i['greedy_first_diff']}, "
                  f"{i['greedy_equal']} / 256 | {b['greedy_first_diff']}, {b['greedy_equal']} / 256 | "
                  f"{100 * q['ppl_rel']:+.2f}% | {100 * q['decode_ppl_rel']:+.2f}% | {q['greedy_first_diff']}, "
                  f"{q['greedy_equal']} / 256 |")
    worst = max(abs(r["int8"]["ppl_rel"]) for r in rows)
    md += ["", f"Largest int8 change of held-out perplexity: {100 * worst:.2f}%; of the decoding step's: "
               f"{100 * max(abs(r['int8']['decode_ppl_rel']) for r in rows):.2f}%. int4 (groups of {INT4_GROUP}): "
               f"{100 * max(abs(r['int4']['ppl_rel']) for r in rows):.2f}% and "
               f"{100 * max(abs(r['int4']['decode_ppl_rel']) for r in rows):.2f}%."]
    name = "quant_accuracy" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    (args.out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
