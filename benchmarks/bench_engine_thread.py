"""Why ``subquad serve`` runs its engine on the main thread (``Engine.run``; ``serve.server``): the same work on
the thread that ran PyTorch's first parallel region and on a second thread, at mamba-130m's shape (random
weights), 2 threads.

    an exp of 24,576 floats        one parallel region (OpenMP), microseconds
    a compiled decoding step       ``compile_decode``, ms per token over 64 greedy steps
    an eager decoding step         the same without it

    python benchmarks/bench_engine_thread.py

With GNU OpenMP (PyTorch's CPU wheels) a second thread that runs parallel regions gets a team of its own whose
workers sleep between regions, and waking them costs tens of microseconds per region: the decoding step, a few
hundred regions, slows by a third or more. Writes results/engine_thread.{json,md}.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

SHAPE = dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5)


def on_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def exp_us() -> float:
    x = torch.randn(24576)
    for _ in range(100):
        x.exp()
    t = time.perf_counter()
    for _ in range(3000):
        x.exp()
    return (time.perf_counter() - t) / 3000 * 1e6


def step_ms(model) -> float:
    with torch.no_grad():
        _, state = model.prefill(torch.tensor([list(range(5, 133))]))
        tok = torch.tensor([5])
        for _ in range(3):
            logits, s = model.step(tok, state)
        t, s = time.perf_counter(), state
        for _ in range(64):
            logits, s = model.step(tok, s)
            tok = logits.argmax(-1)
        return (time.perf_counter() - t) / 64 * 1e3


def main():
    torch.set_num_threads(2)
    from subquad.models import LanguageModel, ModelConfig, from_pretrained
    from subquad.models.decode import compile_decode

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        LanguageModel(ModelConfig(**SHAPE)).save_pretrained(tmp)
        eager, _ = from_pretrained(tmp)
        compiled, _ = from_pretrained(tmp)
    compile_decode(compiled.eval())
    rows = {}
    for name, fn in (("exp of 24,576 floats (us)", exp_us), ("eager step (ms)", lambda: step_ms(eager.eval())),
                     ("compiled step (ms)", lambda: step_ms(compiled))):
        fn()                                              # the main thread's team exists (as after loading)
        main_t, other = min(fn() for _ in range(3)), min(on_thread(fn) for _ in range(3))
        rows[name] = {"main thread": main_t, "second thread": other}
        print(name, {k: round(v, 2) for k, v in rows[name].items()}, flush=True)
    machine = machine_line(matmul_gflops())
    lines = [f"mamba-130m's shape, 2 threads, best of 3; {machine}", "",
             "| work | main thread | second thread | second / main |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['main thread']:.2f} | {v['second thread']:.2f} | "
              f"{v['second thread'] / v['main thread']:.2f} |" for k, v in rows.items()]
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine_thread.json").write_text(json.dumps({"rows": rows, "machine": machine}, indent=1))
    (OUT / "engine_thread.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
