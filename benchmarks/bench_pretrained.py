"""Published checkpoints' shapes on CPU: subquad's from_pretrained model against transformers' own, same
weights (random, at the real shapes: nothing is downloaded).

mamba-130m (d_model 768, 24 layers, vocab 50,280) and mamba2-130m (d_model 768, 24 layers, 24 heads of
64, state 128, 1 group), float32, batch 1: prefill 2,048 tokens and decode 256 tokens one at a time
(greedy: the time of generating n tokens less that of generating 1), tokens/s, interleaved; decode beside the weight-bandwidth bound (bytes of weights read per
token / this machine's measured copy bandwidth). Writes results/pretrained.{json,md}.

    python benchmarks/bench_pretrained.py            # ~5 minutes
    python benchmarks/bench_pretrained.py --quick    # tiny shapes, seconds
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line, parse_args  # noqa: E402
from subquad.models import from_pretrained  # noqa: E402


def hf_model(kind, quick):
    import transformers

    torch.manual_seed(0)
    if kind == "mamba":
        cfg = transformers.MambaConfig(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16)
        if quick:
            cfg = transformers.MambaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, state_size=8)
        return transformers.MambaForCausalLM(cfg).eval()
    cfg = transformers.Mamba2Config(vocab_size=50280, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
                                    state_size=128, n_groups=1, expand=2, tie_word_embeddings=True)
    if quick:
        cfg = transformers.Mamba2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_heads=4,
                                        head_dim=32, state_size=16, n_groups=1, tie_word_embeddings=True)
    return transformers.Mamba2ForCausalLM(cfg).eval()


def copy_gbps():
    a = torch.empty(64 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * 2 * a.numel() / (time.perf_counter() - t) / 1e9      # read + write


@torch.no_grad()
def timings(kind, hf, ours, T, n_new):
    ids = torch.randint(0, hf.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    out = {}
    for who in ("subquad", "transformers", "subquad", "transformers"):          # interleaved, best of two
        t = time.perf_counter()
        if who == "subquad":
            ours(ids)
        else:
            hf(ids)
        pre = time.perf_counter() - t
        def gen(n):
            t = time.perf_counter()
            if who == "subquad":
                ours.generate(ids[0].tolist(), n, temperature=0)
            else:
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return time.perf_counter() - t

        dec = (gen(n_new) - gen(1)) * n_new / (n_new - 1)   # generate prefills too: the difference is decoding
        best = out.setdefault(who, {"prefill_s": pre, "decode_s": dec})
        best["prefill_s"], best["decode_s"] = min(best["prefill_s"], pre), min(best["decode_s"], dec)
    for who, r in out.items():
        r["prefill_tok_s"] = T / r["prefill_s"]
        r["decode_ms_per_token"] = 1e3 * r["decode_s"] / n_new
    return out


def main(argv=None):
    args = parse_args(__doc__, argv)
    T, n_new = (64, 16) if args.quick else (2048, 256)
    machine = machine_line()
    gbps = copy_gbps()
    print(machine, f"copy {gbps:.1f} GB/s", flush=True)
    res = {"machine": machine, "copy_gbps": gbps, "rows": {}}
    for kind in ("mamba", "mamba2"):
        hf = hf_model(kind, args.quick)
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            ours, _ = from_pretrained(d)
        params = sum(p.numel() for p in ours.parameters())
        bound_ms = 1e3 * params * 4 / (gbps * 1e9 / 2)          # every weight read once per token (read only)
        r = timings(kind, hf, ours, T, n_new)
        r["parameters"], r["bound_ms_per_token"] = params, bound_ms
        res["rows"][kind] = r
        print(kind, json.dumps(r), flush=True)
    md = [f"{machine}; copy bandwidth {gbps:.1f} GB/s (read + write). Random weights at the real shapes, float32, "
          f"batch 1; prefill {T:,} tokens, then {n_new} greedy tokens; best of two interleaved runs.", "",
          "| model | parameters | prefill tok/s: subquad | transformers | ratio | decode ms/token: subquad | "
          "transformers | ratio | weight-read bound ms/token |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, r in res["rows"].items():
        s, h = r["subquad"], r["transformers"]
        md.append(f"| {kind} | {r['parameters']:,} | {s['prefill_tok_s']:,.0f} | {h['prefill_tok_s']:,.0f} | "
                  f"{s['prefill_tok_s'] / h['prefill_tok_s']:.2f}x | {s['decode_ms_per_token']:.1f} | "
                  f"{h['decode_ms_per_token']:.1f} | {h['decode_ms_per_token'] / s['decode_ms_per_token']:.2f}x | "
                  f"{r['bound_ms_per_token']:.1f} |")
    (args.out / f"pretrained{args.suffix}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"pretrained{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
