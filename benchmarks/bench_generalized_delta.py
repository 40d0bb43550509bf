"""The generalised delta rule (RWKV-7's op) at the op level: subquad's chunk form against token loops - its
own (``mode="recurrent"``) and a naive one written here the way flash-linear-attention's naive references
are (a per-token einsum over a (B, H, K, V) state) - forward and forward + backward, float32, B = 1, H = 4,
K = V = 64 (RWKV-7's head size), T = 4,096 and 16,384. RWKV-7-shaped inputs: w = -exp(-0.5) sigmoid(x) in
(-0.61, 0), a = -kk, b = lr kk with kk unit and lr in (0, 1); outputs are compared before timing. The token
loops are timed once each (no warm-up: one call is thousands of steps), and with a gradient only the naive
one and only up to ``--loop-grad-max`` tokens (autograd through a token loop takes minutes beyond it).

    python benchmarks/bench_generalized_delta.py              # ~4 minutes
    python benchmarks/bench_generalized_delta.py --quick      # T = 256, 512
    python benchmarks/bench_generalized_delta.py --threads 1  # on a shared machine

The ``rwkv`` package's own CPU path (BlinkDL's ``rwkv``, ``RWKV_V7_ON=1``, strategy "cpu fp32": its TorchScript
token loop; the ``rwkv`` extra installs it) runs a whole model, not the op, so it is measured at the layer:
one RWKV-7 layer (d_model 256 = 4 heads of 64, vocab 256) in BlinkDL's ``.pth`` layout, its logits checked
equal, forward without a gradient (the package has no backward), the package against subquad's
``from_pretrained`` of the same file.
Writes results/generalized_delta.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, fla_file, machine_line, timeit  # noqa: E402
from subquad.ops import generalized_delta_rule  # noqa: E402


def inputs(T, H=4, K=64, grad=False):
    g = torch.Generator().manual_seed(T)
    q, k, kk = (F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1) for _ in range(3))
    w = -math.exp(-0.5) * torch.sigmoid(torch.randn(1, T, H, K, generator=g))
    lr = torch.rand(1, T, H, 1, generator=g)
    x = {"q": q, "k": k, "v": torch.randn(1, T, H, K, generator=g), "w": w, "a": -kk, "b": lr * kk}
    return {n: t.requires_grad_(grad) for n, t in x.items()}


def chunk(x):
    return generalized_delta_rule(*x.values(), mode="chunk", output_final_state=True)


def recurrent(x):
    return generalized_delta_rule(*x.values(), mode="recurrent", output_final_state=True)


def naive(x):
    """S_t = exp(w_t) o S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T, o_t = S_t^T q_t / sqrt(K), in fla's layout."""
    q, k, v, w, a, b = (t.transpose(1, 2) for t in x.values())         # (B, H, T, .)
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = []
    for t in range(T):
        S = (S * w[:, :, t, :, None].exp() + torch.einsum("bhk,bhv->bhkv", b[:, :, t], torch.einsum("bhk,bhkv->bhv", a[:, :, t], S))
             + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t]))
        o.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) * K ** -0.5)
    return torch.stack(o, 2).transpose(1, 2), S


def package_rows(lengths, repeats, tmp):
    """The rwkv package's forward (its token loop) against subquad's, one RWKV-7 layer from the same .pth;
    [] when the package is not installed."""
    import importlib.util
    import os

    if importlib.util.find_spec("rwkv") is None:
        print("rwkv package not installed: its rows skipped (pip install -e '.[rwkv]')", flush=True)
        return []
    os.environ["RWKV_V7_ON"] = "1"
    from rwkv.model import RWKV

    from subquad.models import from_pretrained
    from subquad.testing import random_rwkv7_pth

    path = Path(tmp) / "layer.pth"
    random_rwkv7_pth(path, 256, 256, 1, {"w": 32, "a": 32, "v": 16, "g": 64})
    theirs, (ours, _) = RWKV(str(path.with_suffix("")), "cpu fp32"), from_pretrained(path)
    rows = []
    with torch.no_grad():
        theirs.forward(list(range(64)), None, full_output=True)     # TorchScript's first-call optimisation
    for T in lengths:
        ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            out = {}
            s_theirs = timeit(lambda: out.__setitem__("p", theirs.forward(ids.tolist(), None, full_output=True)[0]),
                              1, warmup=0)
            s_ours = timeit(lambda: out.__setitem__("s", ours(ids[None])[0]), repeats)
        diff = ((out["s"] - out["p"]).abs().max() / out["p"].abs().max()).item()
        rows.append({"T": T, "fwd_package_s": s_theirs, "fwd_subquad_s": s_ours, "max_rel_diff": diff})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fla_chunkwise():
    """flash-linear-attention's pure-PyTorch chunk form of the same rule (``ops/generalized_delta_rule/dplr/
    naive.py``: ``dplr_chunkwise``, chunk 32, (B, H, T, K) layout), or None when fla is not installed
    (``pip install -e '.[bench]'``; fla-core holds the ops since fla 0.6)."""
    mod = fla_file("ops/generalized_delta_rule/dplr/naive.py")
    if mod is None:
        return None

    def run(x):
        q, k, v, w, a, b = (t.transpose(1, 2) for t in x.values())
        o, S = mod.dplr_chunkwise(q, k, v, a, b, w, output_final_state=True, chunk_size=32)
        return o.transpose(1, 2), S
    return run


def fwd_bwd(fn, x):
    def step():
        o, S = fn(x)
        (o.square().mean() + S.square().mean()).backward()
        for t in x.values():
            t.grad = None
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-grad-max", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="1 where the machine is shared (threads stall under load)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_line()
    print(machine, flush=True)
    forms = {"chunk": chunk, "recurrent": recurrent, "naive": naive}
    fla = fla_chunkwise()
    if fla is None:
        print("flash-linear-attention not installed: its row skipped", flush=True)
    else:
        forms["fla"] = fla
    rows = []
    for T in ((256, 512) if args.quick else (4096, 16384)):
        x = inputs(T)
        row = {"T": T}
        with torch.no_grad():
            outs = {}
            for name, fn in forms.items():
                once = name not in ("chunk", "fla")
                row[f"fwd_{name}_s"] = timeit(lambda: outs.__setitem__(name, fn(x)), 1 if once else args.repeats,
                                              warmup=0 if once else 1)
        o2, s2 = outs["naive"]
        row["max_rel_diff"] = max(max(((o1 - o2).abs().max() / o2.abs().max()).item(),
                                      ((s1 - s2).abs().max() / s2.abs().max()).item())
                                  for name, (o1, s1) in outs.items() if name != "naive")
        xg = inputs(T, grad=True)
        row["fwdbwd_chunk_s"] = timeit(fwd_bwd(chunk, xg), args.repeats)
        row["fwdbwd_recurrent_s"] = None
        row["fwdbwd_naive_s"] = timeit(fwd_bwd(naive, xg), 1, warmup=0) if T <= args.loop_grad_max else None
        if fla is not None:
            row["fwdbwd_fla_s"] = timeit(fwd_bwd(fla, xg), args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        layer = package_rows([r["T"] for r in rows], args.repeats, tmp)
    md = [f"{machine}. generalized_delta_rule, float32, B=1, H=4, K=V=64; chunk: median of {args.repeats}, "
          "token loops: one call; — = not measured (autograd through a token loop: minutes).", "",
          "| T | pass | chunk | token loop (recurrent) | ratio | naive token loop | ratio |"
          + (" fla dplr_chunkwise (naive.py) | ratio |" if fla else ""),
          "|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if fla else "")]
    for r in rows:
        for pas, key in (("forward", "fwd"), ("fwd+bwd", "fwdbwd")):
            c, *others = (r.get(f"{key}_{name}_s") for name in forms)
            cells = ["—, —" if s is None else f"{s * 1e3:,.0f} ms, {s / c:.1f}x" for s in others]
            md.append(f"| {r['T']:,} | {pas} | {c * 1e3:,.0f} ms | " + " | ".join(c_.replace(", ", " | ") for c_ in cells)
                      + " |")
    md += ["", "Max relative difference of o and the final state, chunk, recurrent (and fla) against the naive loop: "
           + ", ".join(f"T={r['T']:,}: {r['max_rel_diff']:.1e}" for r in rows) + "."]
    if layer:
        md += ["", "One RWKV-7 layer (d_model 256, 4 heads of 64), forward without a gradient: the rwkv package "
               "(its CPU token loop) against subquad, the same .pth:", "",
               "| T | rwkv package | subquad | ratio | max rel. diff of logits |", "|---:|---:|---:|---:|---:|"]
        md += [f"| {r['T']:,} | {r['fwd_package_s'] * 1e3:,.0f} ms | {r['fwd_subquad_s'] * 1e3:,.0f} ms | "
               f"{r['fwd_package_s'] / r['fwd_subquad_s']:.1f}x | {r['max_rel_diff']:.1e} |" for r in layer]
    suffix = "_quick" if args.quick else ""
    (args.out / f"generalized_delta{suffix}.json").write_text(json.dumps({"machine": machine, "rows": rows,
                                                                         "package_rows": layer}, indent=2))
    (args.out / f"generalized_delta{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
