"""Beyond one process, on this machine's CPU: ring attention and state passing on P gloo processes.

T = 16,384 (--quick: 2,048), B=1, H=8, K=V=64, float32, P = 4 processes (one thread each):
- ring attention (causal, zigzag) forward and forward+backward against single-process
  attention (SDPA, 2 threads), with each rank's peak resident memory;
- bytes each rank sends: ring attention (K and V around the ring, dK and dV on the
  way back) against state passing for linear attention and GLA (one all-gather of
  the piece's state and transition), counted from the tensors sent;
- state passing's time against the single-process chunk form.
The 4 processes share 2 cores here, so times are upper bounds of what 4 machines
would take; the bytes and the per-rank memory are what matter. Writes results/distributed.{json,md}.

    python benchmarks/bench_distributed.py [--quick]
"""

from __future__ import annotations

import json
import os
import resource
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

H, K, V, P = 8, 64, 64, 4


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank, world, init, T, out):
    from subquad.distributed import ring_attention, sequence_parallel, zigzag_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    base = _rss_mb()
    shard = [zigzag_shard(x, rank, world).contiguous() for x in (q, k, v)]
    dist.barrier()
    t = time.perf_counter()
    with torch.no_grad():
        ring_attention(*shard)
    dist.barrier()
    ring_fwd = time.perf_counter() - t
    xs = [s.clone().requires_grad_() for s in shard]
    dist.barrier()
    t = time.perf_counter()
    ring_attention(*xs).sum().backward()
    dist.barrier()
    ring_fb = time.perf_counter() - t
    ring_mem = _rss_mb() - base
    piece = T // world
    sl = slice(rank * piece, (rank + 1) * piece)
    ql, kl, vl = F.elu(q[:, sl]) + 1, F.elu(k[:, sl]) + 1, v[:, sl]
    gk = F.logsigmoid(torch.randn(1, piece, H, K, generator=torch.Generator().manual_seed(rank)) + 3)
    dist.barrier()
    t = time.perf_counter()
    with torch.no_grad():
        sequence_parallel("linear_attention", ql, kl, vl, normalize=True)
    dist.barrier()
    sp_lin = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        sequence_parallel("gla", ql, kl, vl, g=gk)
    dist.barrier()
    sp_gla = time.perf_counter() - t
    torch.save({"ring_fwd": ring_fwd, "ring_fwdbwd": ring_fb, "ring_rss_mb": ring_mem,
                "sp_linear": sp_lin, "sp_gla": sp_gla}, os.path.join(out, f"r{rank}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(__doc__, argv)
    T = 2048 if args.quick else 16384
    c = T // (2 * P)
    # bytes each rank sends, from the shapes of what the functions send (float32)
    shard = 2 * c * H * K * 4
    ring_fwd_bytes = (P - 1) * 2 * shard                  # K and V to the next rank, P - 1 times
    ring_bwd_bytes = (P - 1) * 4 * shard + 2 * shard      # K, V, dK, dV on the way, dK and dV home
    state = H * K * (V + 1) * 4                           # S and z of linear attention
    sp_lin_bytes = state                                  # one all-gather: each rank contributes its state
    sp_gla_bytes = H * K * V * 4 + H * K * K * 4          # state and K x K transition
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(P, os.path.join(d, "rdv"), T, d), nprocs=P, join=True)
        ranks = [torch.load(os.path.join(d, f"r{r}.pt")) for r in range(P)]
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    from subquad.ops import gla, linear_attention
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    base = _rss_mb()
    t = time.perf_counter()
    with torch.no_grad():
        F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    single_fwd = time.perf_counter() - t
    xs = [x.clone().requires_grad_() for x in (qh, kh, vh)]
    t = time.perf_counter()
    F.scaled_dot_product_attention(*xs, is_causal=True).sum().backward()
    single_fb = time.perf_counter() - t
    single_mem = _rss_mb() - base
    t = time.perf_counter()
    with torch.no_grad():
        linear_attention(F.elu(q) + 1, F.elu(k) + 1, v)
    single_lin = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        gla(F.elu(q) + 1, F.elu(k) + 1, v, F.logsigmoid(torch.randn(1, T, H, K) + 3))
    single_gla = time.perf_counter() - t
    worst = {key: max(r[key] for r in ranks) for key in ranks[0]}
    md = [f"**Ring attention and state passing, T={T:,}, B=1, H=8, K=V=64, float32, {P} gloo processes on 2 cores**",
          "", "| | time | peak memory per process (RSS growth) | bytes sent per rank |", "|---|---|---|---|",
          f"| single-process SDPA, forward | {fmt_ms(single_fwd)} | — | — |",
          f"| single-process SDPA, forward+backward | {fmt_ms(single_fb)} | {single_mem:,.0f} MB | — |",
          f"| ring attention, forward | {fmt_ms(worst['ring_fwd'])} | — | {ring_fwd_bytes:,} |",
          f"| ring attention, forward+backward | {fmt_ms(worst['ring_fwdbwd'])} | {worst['ring_rss_mb']:,.0f} MB | "
          f"{ring_fwd_bytes + ring_bwd_bytes:,} |",
          f"| single-process linear attention (chunk), forward | {fmt_ms(single_lin)} | — | — |",
          f"| state passing, linear attention, forward | {fmt_ms(worst['sp_linear'])} | — | {sp_lin_bytes:,} |",
          f"| single-process GLA (chunk), forward | {fmt_ms(single_gla)} | — | — |",
          f"| state passing, GLA, forward | {fmt_ms(worst['sp_gla'])} | — | {sp_gla_bytes:,} |",
          "", f"Ring attention sends {ring_fwd_bytes / sp_gla_bytes:,.0f}x the bytes of GLA's state passing in forward;"
          " its messages grow with T, state passing's do not."]
    (args.out / f"distributed{args.suffix}.json").write_text(json.dumps(
        {"T": T, "P": P, "ranks": ranks, "single": {"sdpa_fwd": single_fwd, "sdpa_fwdbwd": single_fb,
                                                     "linear": single_lin, "gla": single_gla, "sdpa_mem_mb": single_mem},
         "bytes": {"ring_fwd": ring_fwd_bytes, "ring_bwd": ring_bwd_bytes, "sp_linear": sp_lin_bytes,
                   "sp_gla": sp_gla_bytes}}, indent=2))
    (args.out / f"distributed{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
