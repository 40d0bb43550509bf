"""What a speculative verification costs against the compiled decoding step (issue 50's target: verifying 8
tokens <= 1.5x one compiled float32 step at mamba-130m's shape), random weights, batch 1 (``--batch``), 2 threads:

    compiled step        model.step after ``compile_decode`` (its graph compiled before timing); both models
                         in ``decode_layout``, as ``from_pretrained`` leaves them
    eager step           model.step without it
    prefill 8            model.prefill of 8 tokens from a state (eager: what a verification's forward runs)
    verify 8             ``models.speculative.verify`` of 8 tokens, eager (the prefill with the taps that record
                         the rollback's inputs) and ``accept(j)`` of j = 4 (a replay of every recurrent layer)
    verify 8 (states)    the same eagerly under ``PER_TOKEN`` (``how="states"``: each Mamba layer's state kept
                         after every token, so ``accept(4)`` picks the 4th)
    compiled verify 8    the same through the compiled verification (``CompiledStep.verifier``: one graph over the
                         8 tokens that keeps each Mamba layer's state after every token) and ``accept(4)`` (a
                         pick of the 4th); its graph compiled before timing

    python benchmarks/bench_verify.py            # ~2 min (the compile is most of it)
    python benchmarks/bench_verify.py --no-compile   # the eager rows, against the eager step
    python benchmarks/bench_verify.py --model hybrid --no-compile   # bench_llama_server's HYBRID (Bamba's
                                                 # structure: Mamba-2 blocks with MLPs, attention every 6th)
    python benchmarks/bench_verify.py --model hybrid --no-compile --batch 8 --tokens 2   # a batch's drafts
                                                 # (models.speculative.draft_budget: 1 each at 8 rows)

    verify 8 (replay)    the eager verification that replays the kept tokens (``how="replay"``)

Median of ``--repeats`` interleaved rounds, after warm-up; prints ms and ratios to the compiled step, writes
results/verify.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_compile_cache import CASES  # noqa: E402
from benchmarks.bench_llama_server import HYBRID  # noqa: E402
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402
from subquad.models import LanguageModel, ModelConfig  # noqa: E402
from subquad.models.decode import compile_decode, decode_layout  # noqa: E402
from subquad.models.speculative import verify  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8, help="tokens verified (the fed token and k - 1 drafts)")
    ap.add_argument("--no-compile", action="store_true", help="the eager rows only, ratios to the eager step")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model of width 128: checks the script runs")
    ap.add_argument("--model", choices=["mamba-130m", "hybrid"], default="mamba-130m")
    ap.add_argument("--batch", type=int, default=1, help="rows verified at once (each its own prompt)")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    fields = dict(CASES["mamba-130m"][0] if a.model == "mamba-130m" else HYBRID)
    if a.quick:
        fields.update(d_model=128, n_layers=2, vocab_size=1000, n_heads=4, n_kv_heads=None,
                      pattern="mamba" if a.model == "mamba-130m" else "mamba2,softmax")
        a.repeats = 3
    torch.manual_seed(0)
    eager = LanguageModel(ModelConfig(**fields)).eval()
    fast = compile_decode(LanguageModel(ModelConfig(**fields)).eval())
    fast.load_state_dict(eager.state_dict())
    decode_layout(eager), decode_layout(fast)            # as from_pretrained leaves a model
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, fields["vocab_size"], (a.batch, 64), generator=g)
    block = torch.randint(0, fields["vocab_size"], (a.batch, a.tokens), generator=g)
    tok = block[:, 0]
    with torch.no_grad():
        _, state = eager.prefill(prompt)
        _, fstate = fast.prefill(prompt)
        t = time.perf_counter()
        for _ in range(0 if a.no_compile else 3):
            fast.step(tok, fstate)                       # the graph (batch 1) compiled or loaded here
        compile_s = time.perf_counter() - t

        def compiled():
            fast.step(tok, fstate)

        def eager_step():
            eager.step(tok, state)

        def prefill():
            eager.prefill(block, state)

        def verify_accept():
            _, ver = verify(eager, block, state)
            ver.accept(a.tokens // 2)

        def replay_verify_accept():
            _, ver = verify(eager, block, state, how="replay")
            ver.accept(a.tokens // 2)

        def states_verify_accept():
            _, ver = verify(eager, block, state, how="states")
            ver.accept(a.tokens // 2)

        def compiled_verify_accept():
            _, ver = verify(fast, block, fstate)
            ver.accept(a.tokens // 2)

        t = time.perf_counter()
        if not a.no_compile:
            compiled_verify_accept()                      # its graph compiled (or loaded) here
        verify_compile_s = time.perf_counter() - t

        n, j = a.tokens, a.tokens // 2
        cases = {"compiled step": compiled, "eager step": eager_step, f"prefill {n}": prefill,
                 f"verify {n} + accept {j}": verify_accept, f"verify {n} (replay) + accept {j}": replay_verify_accept,
                 f"verify {n} (states) + accept {j}": states_verify_accept,
                 f"compiled verify {n} + accept {j}": compiled_verify_accept}
        if a.no_compile:
            cases = {k: v for k, v in cases.items() if "compiled" not in k}
        for fn in cases.values():
            fn()
        times = {k: [] for k in cases}
        for _ in range(a.repeats):
            for name, fn in cases.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    base = ms["eager step" if a.no_compile else "compiled step"]
    machine = machine_line(matmul_gflops())
    lines = [f"{a.model}'s shape{' (quick: width 128, 2 layers)' if a.quick else ''}, batch {a.batch}, float32; "
             f"{machine}; first compiled steps {compile_s:.1f} s, first compiled verification {verify_compile_s:.1f} s",
             "",
             f"| call | ms | x {'eager' if a.no_compile else 'compiled'} step |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {v / base:.2f} |" for k, v in ms.items()]
    print("\n".join(lines))
    if not a.quick and not a.no_compile and a.model == "mamba-130m" and a.batch == 1:
        (OUT / "verify.json").write_text(json.dumps({"ms": ms, "machine": machine, "tokens": a.tokens}, indent=1))
        (OUT / "verify.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
