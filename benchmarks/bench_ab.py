"""Interleaved A/B timing of two checkouts of subquad: did a change make any path slower?

    python benchmarks/bench_ab.py --a /tmp/base --b . --rounds 3 [--out ab.md] [--rows REGEX]

Each round runs one fresh process per tree (A, B, A, B, ...), each measuring every row once
(the fastest of five calls), so both trees see the same machine weather. A row's time is the fastest
over rounds (the machine is shared: the minimum is the estimate least moved by neighbours); the ratio is B / A (below 1: B is faster). Only public entry points are used
(``build_mixer``, a layer's ``forward`` and ``empty_state``, the ops by name), so any two
versions with the same public API compare.

Rows: every mixer of the registry at d_model 256, 4 heads - training (forward + backward,
T = 2,048), prefill (no gradient, T = 8,192: the piece-wise and no-gradient paths) and one
decoding step (T = 1, with a state); every op's chunk form at B = 1, H = 4, K = V = 64, T = 4,096,
forward without a gradient and forward + backward. ``--rows`` keeps only the rows whose name matches a
regular expression (``re.search``), e.g. ``--rows "retention|gla|linear"`` or a doubtful row alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, re, sys, time, statistics, torch
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]))
want = re.compile(sys.argv[2]).search
from subquad.layers import build_mixer
import subquad.ops as ops

def med(fn, n=5, warm=1):
    for _ in range(warm): fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)

rows = {}
D, H = 256, 4
for name in ["softmax", "swa", "linear", "retention", "gla", "mamba", "mamba2", "deltanet", "gated_deltanet"]:
    if not any(want(f"{name} {row}") for row in ("train T=2048", "prefill T=8192", "decode step")):
        continue
    m = build_mixer(name, D, H)
    x = torch.randn(1, 2048, D, requires_grad=True)
    def train():
        y, _ = m(x); y.sum().backward()
    if want(f"{name} train T=2048"):
        rows[f"{name} train T=2048"] = med(train)
    xp = torch.randn(1, 8192, D)
    with torch.no_grad():
        if want(f"{name} prefill T=8192"):
            rows[f"{name} prefill T=8192"] = med(lambda: m(xp), n=2)
        _, s = m(torch.randn(1, 64, D))
        x1 = torch.randn(1, 1, D)
        def step():
            st = s
            for _ in range(32):
                _, st = m(x1, st)
        if want(f"{name} decode step"):
            rows[f"{name} decode step"] = med(step) / 32

B, T, Hh, K = 1, 4096, 4, 64
def qkv(req):
    q, k, v = (torch.randn(B, T, Hh, K) * 0.3 for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    return [t.requires_grad_(req) for t in (q, k, v)]
def gates(name, req):
    if name == "retention": return (torch.full((Hh,), -0.05),)
    if name == "simple_gla": return ((-torch.rand(B, T, Hh) * 0.2).requires_grad_(req),)
    if name == "gla": return ((-torch.rand(B, T, Hh, K) * 0.2).requires_grad_(req),)
    if name == "delta_rule": return (torch.rand(B, T, Hh).requires_grad_(req),)
    if name == "gated_delta_rule": return ((-torch.rand(B, T, Hh) * 0.2).requires_grad_(req), torch.rand(B, T, Hh).requires_grad_(req))
    return ()
for name in ["linear_attention", "retention", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "softmax_attention"]:
    fn = getattr(ops, name)
    with torch.no_grad():
        a = qkv(False) + list(gates(name, False))
        if want(f"op {name} fwd"):
            rows[f"op {name} fwd"] = med(lambda: fn(*a, mode="chunk"))
    a = qkv(True) + list(gates(name, True))
    def fb():
        o, _ = fn(*a, mode="chunk"); o.sum().backward()
    if want(f"op {name} fwd+bwd"):
        rows[f"op {name} fwd+bwd"] = med(fb)
x, dt = torch.randn(1, T, 512), torch.rand(1, T, 512) * 0.1
A, Bm, Cm = -torch.rand(512, 16) - 0.5, torch.randn(1, T, 16), torch.randn(1, T, 16)
with torch.no_grad():
    if want("op selective_scan fwd"):
        rows["op selective_scan fwd"] = med(lambda: ops.selective_scan(x, dt, A, Bm, Cm))
print("ROWS" + json.dumps(rows))
'''


def run(tree: Path, threads: int, rows: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    # cwd=tree: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH, so a child
    # started elsewhere inside a checkout would import that checkout instead of ``tree``
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), rows], env=env, capture_output=True, text=True,
                         cwd=tree)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.split("ROWS", 1)[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the baseline checkout")
    ap.add_argument("--b", type=Path, default=Path("."), help="the changed checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    ap.add_argument("--rows", default="", help="only the rows whose name matches this regular expression")
    args = ap.parse_args()
    res = {"A": [], "B": []}
    for r in range(args.rounds):
        for tag, tree in (("A", args.a), ("B", args.b)) if r % 2 == 0 else (("B", args.b), ("A", args.a)):
            res[tag].append(run(tree, args.threads, args.rows))
            print(f"round {r + 1}/{args.rounds}: {tag} done", file=sys.stderr, flush=True)
    rows = list(res["A"][0])
    lines = [f"| row | A ms | B ms | B / A |", "|---|---:|---:|---:|"]
    ratios = []
    for row in rows:
        a = min(x[row] for x in res["A"]) * 1e3
        b = min(x[row] for x in res["B"]) * 1e3
        ratios.append(b / a)
        lines.append(f"| {row} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    geo = statistics.geometric_mean(ratios)
    lines.append(f"| geometric mean of ratios | | | {geo:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
