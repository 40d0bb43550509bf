"""Context-parallel training of a hybrid language model: one sequence over P gloo processes.

A Jamba-like hybrid (3 Mamba-2 layers, 1 softmax layer, d_model 128, SwiGLU, vocab 4,096),
B=1, T = 16,384 (--quick: 2,048), float32. One training step (forward + backward of the
next-token loss) on one process (2 threads) against `context_parallel` over P = 2 and 4
processes (1 thread each): time of the slowest rank, each rank's peak resident memory
growth (VmHWM after a reset), and the bytes each rank hands to torch.distributed, counted from the tensors it
sends (ring attention's K/V and dK/dV shards, the state passing's states and transitions,
the convolutions' halos). The processes share 2 cores here: times are what 2 cores do with
P ranks' work, not what P machines would; bytes and memory per rank are what carry over.
Writes results/context_parallel.{json,md}.

    python benchmarks/bench_context_parallel.py [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import fmt_ms, parse_args  # noqa: E402

PATTERN, D_MODEL, VOCAB = "mamba2*3,softmax", 128, 4096


def _model(T):
    from subquad.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=4, n_heads=4, context_length=T,
                                     pattern=PATTERN))


def _data(T):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (1, T + 1), generator=g)


def _status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


def _reset_peak():
    """Current resident MB, with the peak (VmHWM) reset to it: ru_maxrss would carry the parent's peak
    into spawned processes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_mb("VmRSS")


def _peak_growth_mb(base):
    return _status_mb("VmHWM") - base


class _Counter:
    """Bytes this rank hands to torch.distributed's send-side calls (all_gather inputs, isend buffers)."""

    def __init__(self):
        self.bytes = 0
        self._gather, self._batch = dist.all_gather, dist.batch_isend_irecv

        def all_gather(out, x, *a, **k):
            self.bytes += x.nelement() * x.element_size()
            return self._gather(out, x, *a, **k)

        def batch_isend_irecv(ops):
            self.bytes += sum(o.tensor.nelement() * o.tensor.element_size() for o in ops if o.op is dist.isend)
            return self._batch(ops)
        dist.all_gather, dist.batch_isend_irecv = all_gather, batch_isend_irecv


def _worker(rank, world, init, T, out):
    from subquad.distributed import context_parallel, zigzag_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    model = _model(T)
    idx = _data(T)
    x, y = zigzag_shard(idx[:, :-1], rank, world), zigzag_shard(idx[:, 1:], rank, world)
    counter = _Counter()
    base = _reset_peak()
    dist.barrier()
    t = time.perf_counter()
    with context_parallel():
        logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    dist.barrier()
    elapsed = time.perf_counter() - t
    torch.save({"seconds": elapsed, "rss_mb": _peak_growth_mb(base), "bytes": counter.bytes, "loss": loss.item()},
               os.path.join(out, f"r{rank}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(__doc__, argv)
    T = 2048 if args.quick else 16384
    torch.set_num_threads(2)
    model = _model(T)
    idx = _data(T)
    base = _reset_peak()
    t = time.perf_counter()
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[0, 1:])
    loss.backward()
    single = {"seconds": time.perf_counter() - t, "rss_mb": _peak_growth_mb(base), "loss": loss.item()}
    print(f"one process: {fmt_ms(single['seconds'])}, +{single['rss_mb']:.0f} MB", flush=True)
    runs = {}
    for P in (2, 4):
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(P, os.path.join(d, "rdv"), T, d), nprocs=P, join=True)
            ranks = [torch.load(os.path.join(d, f"r{r}.pt")) for r in range(P)]
        runs[P] = {"ranks": ranks, "seconds": max(r["seconds"] for r in ranks),
                   "rss_mb": max(r["rss_mb"] for r in ranks), "bytes": max(r["bytes"] for r in ranks),
                   "loss": sum(r["loss"] for r in ranks) / P}
        print(f"P={P}: {fmt_ms(runs[P]['seconds'])}, +{runs[P]['rss_mb']:.0f} MB per rank, "
              f"{runs[P]['bytes']:,} B sent per rank, loss {runs[P]['loss']:.6f} (one process {single['loss']:.6f})",
              flush=True)
    md = [f"**Context-parallel training step, {PATTERN} (d_model {D_MODEL}, vocab {VOCAB:,}), B=1, T={T:,}, "
          "float32, gloo on 2 cores**", "",
          "| | time (slowest rank) | peak memory growth per rank | bytes sent per rank | loss |", "|---|---|---|---|---|",
          f"| one process (2 threads) | {fmt_ms(single['seconds'])} | {single['rss_mb']:,.0f} MB | — | "
          f"{single['loss']:.6f} |"]
    md += [f"| context parallel, P={P} (1 thread each) | {fmt_ms(r['seconds'])} | {r['rss_mb']:,.0f} MB | "
           f"{r['bytes']:,} | {r['loss']:.6f} |" for P, r in runs.items()]
    (args.out / f"context_parallel{args.suffix}.json").write_text(json.dumps(
        {"T": T, "pattern": PATTERN, "single": single, "runs": {str(k): v for k, v in runs.items()}}, indent=2))
    (args.out / f"context_parallel{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
