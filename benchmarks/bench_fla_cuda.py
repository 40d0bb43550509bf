"""subquad's chunk ops and one decoding step on a GPU against flash-linear-attention's Triton kernels.

The other benchmarks run on the CPU against fla's pure-PyTorch references; this one is the GPU row:

    op rows       linear attention, simple GLA, GLA, the delta rule and the gated delta rule, chunk form,
                  forward and forward+backward: subquad ``<op>(mode="chunk")`` against fla's ``chunk_<op>``
    decode rows   one token with a state: subquad ``<op>(mode="recurrent")`` against fla's
                  ``fused_recurrent_<op>``

B=2, 8 heads of 64, bfloat16 inputs (states float32), T = 1K, 4K (``--quick``: 1K). Each row also gives the
largest difference between the two outputs, relative to the largest output value, so a fast wrong
kernel shows. A peer that is missing or raises is a row with its error, not a crash. Writes
results/fla_cuda{,_quick}.{json,md}.

    python benchmarks/bench_fla_cuda.py --quick      # seconds on a GPU (scripts/device_check.sh runs it)
    python benchmarks/bench_fla_cuda.py --device cpu --quick   # subquad's rows only: a check of this script
"""

from __future__ import annotations

import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import fmt_ms, parse_args  # noqa: E402
from subquad import ops  # noqa: E402

B, H, K = 2, 8, 64
# op -> (fla module, its chunk function, its recurrent function, the gates the op takes)
OPS = {
    "linear_attention": ("fla.ops.linear_attn", "chunk_linear_attn", "fused_recurrent_linear_attn", ()),
    "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla", "fused_recurrent_simple_gla", ("g",)),
    "gla": ("fla.ops.gla", "chunk_gla", "fused_recurrent_gla", ("gk",)),
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule", ("beta",)),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                         ("g", "beta")),
}


def inputs(op: str, T: int, device, dtype=torch.bfloat16) -> dict:
    """q, k, v (B, T, H, K), the op's gates, a float32 state (B, H, K, K); keys unit-norm for the delta rules
    (their stability condition). ``gk``: GLA's per-key decay (B, T, H, K); ``g`` per head (B, T, H)."""
    gen = torch.Generator(device="cpu").manual_seed(T)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cpu")     # the same numbers on every device
    q, k, v = rand(B, T, H, K) * 0.5, rand(B, T, H, K) * 0.5, rand(B, T, H, K)
    if "delta" in op:
        k = torch.nn.functional.normalize(k, dim=-1)
    x = {"q": q, "k": k, "v": v}
    gates = OPS[op][3]
    if "g" in gates:
        x["g"] = torch.nn.functional.logsigmoid(rand(B, T, H) + 3)       # decays near 1, as trained models have
    if "gk" in gates:
        x["gk"] = torch.nn.functional.logsigmoid(rand(B, T, H, K) + 3)
    if "beta" in gates:
        x["beta"] = torch.rand(B, T, H, generator=gen, device="cpu")
    x = {n: t.to(device, dtype) for n, t in x.items()}
    x["S"] = (rand(B, H, K, K) * 0.1).to(device)                            # float32, as both keep states
    return x


def ours(op: str, mode: str):
    """subquad's op in ``mode``: (o, final_state) from the inputs dict."""
    fn = getattr(ops, op)

    def call(x, state=None):
        gates = [x[n] for n in OPS[op][3]]
        extra = {"normalize": False} if op == "linear_attention" else {}
        return fn(x["q"], x["k"], x["v"], *gates, mode=mode, initial_state=state,
                  output_final_state=state is not None, **extra)
    return call


def theirs(op: str, which: int):
    """fla's Triton function (``which`` 1: chunk, 2: fused recurrent) as (o, final_state) from the inputs
    dict, or the reason it is missing. Gates go by keyword (fla names GLA's gate ``g`` in its chunk form and
    ``gk`` in its recurrent one); ``head_first=False`` where a version still takes it ([B, T, H, K])."""
    module, name = OPS[op][0], OPS[op][which]
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:                     # fla absent, or a version without this op
        return f"{module}.{name}: {type(e).__name__}: {e}"
    params = inspect.signature(fn).parameters

    def call(x, state=None):
        kw = {}
        for n in OPS[op][3]:
            kw["g" if n == "gk" and "gk" not in params else n] = x[n]
        if "head_first" in params:
            kw["head_first"] = False
        if "normalize" in params:
            kw["normalize"] = False
        return fn(x["q"], x["k"], x["v"], initial_state=state, output_final_state=state is not None, **kw)
    return call


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()``, the device synchronised around each call (Triton autotunes in warm-up)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rel_diff(a, b) -> float:
    """max |a - b| / max |b|, in float32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def measure(call, x, state, device, repeats: int, backward: bool):
    """(seconds forward, seconds forward+backward or None, output) of one implementation."""
    with torch.no_grad():
        out = call(x, state)[0]
        fwd = time_call(lambda: call(x, state), device, repeats)
    if not backward:
        return fwd, None, out
    xg = {n: (t.detach().requires_grad_() if n != "S" else t) for n, t in x.items()}
    fwdbwd = time_call(lambda: call(xg, state)[0].float().sum().backward(), device, repeats)
    return fwd, fwdbwd, out


def row(kind, op, T, impl, device, repeats, backward, call, x, state, ref=None) -> dict:
    r = {"kind": kind, "op": op, "T": T, "impl": impl, "fwd": None, "fwdbwd": None, "rel_diff": None, "error": None}
    if isinstance(call, str):
        r["error"] = call
    else:
        try:
            r["fwd"], r["fwdbwd"], out = measure(call, x, state, device, repeats, backward)
            r["rel_diff"] = None if ref is None else rel_diff(out, ref)
            r["out"] = out
        except Exception as e:                 # a kernel that fails on this GPU or version: said, not fatal
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    diff = "" if r["rel_diff"] is None else f"  rel diff {r['rel_diff']:.1e}"
    print(f"  {kind:<6} {op:<17} T={T:>5} {impl:<8} fwd {fmt_ms(r['fwd']):>9}  fwd+bwd {fmt_ms(r['fwdbwd']):>9}"
          f"{diff}{'  ' + r['error'] if r['error'] else ''}", flush=True)
    return r


def run(device, lengths, repeats) -> list[dict]:
    rows = []
    for op in OPS:
        for T in lengths:                      # op rows: the chunk form over T tokens, no state
            x = inputs(op, T, device)
            a = row("op", op, T, "subquad", device, repeats, True, ours(op, "chunk"), x, None)
            rows += [a, row("op", op, T, "fla", device, repeats, True, theirs(op, 1), x, None, a.get("out"))]
        x = inputs(op, 1, device)              # decode rows: one token on a state
        a = row("decode", op, 1, "subquad", device, repeats * 10, False, ours(op, "recurrent"), x, x["S"])
        rows += [a, row("decode", op, 1, "fla", device, repeats * 10, False, theirs(op, 2), x, x["S"], a.get("out"))]
    for r in rows:
        r.pop("out", None)
    return rows


def table(rows: list[dict], caption: str) -> list[str]:
    out = [f"**{caption}**", "", "| kind | op | T | subquad fwd | fla fwd | subquad fwd+bwd | fla fwd+bwd | "
           "rel diff | fla error |", "|---|---|---|---|---|---|---|---|---|"]
    get = {(r["kind"], r["op"], r["T"], r["impl"]): r for r in rows}
    for (kind, op, T, impl), a in get.items():
        if impl != "subquad":
            continue
        b = get[(kind, op, T, "fla")]
        diff = "—" if b["rel_diff"] is None else f"{b['rel_diff']:.1e}"
        out.append(f"| {kind} | {op} | {T:,} | {fmt_ms(a['fwd'])} | {fmt_ms(b['fwd'])} | {fmt_ms(a['fwdbwd'])} | "
                   f"{fmt_ms(b['fwdbwd'])} | {diff} | {b['error'] or a['error'] or ''} |")
    return out


def main(argv=None):
    args = parse_args(__doc__, argv, extra=lambda p: p.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu to check the script (fla's kernels need CUDA)"))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available here (--device cpu checks the script)")
    lengths, repeats = ([1024], 3) if args.quick else ([1024, 4096], 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}", flush=True)
    rows = run(device, lengths, repeats)
    md = table(rows, f"{name}, torch {torch.__version__}: B={B}, {H} heads of {K}, bfloat16 inputs; "
                     "median seconds, device synchronised")
    (args.out / f"fla_cuda{args.suffix}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    (args.out / f"fla_cuda{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
