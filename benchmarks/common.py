"""Shared helpers for benchmark scripts: timing, the machine's matmul rate, loading peers."""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results"


def timeit(fn, repeats: int = 5, warmup: int = 1, budget_s: float = 20.0) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (fewer if one run is slow)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    gc.collect()
    return statistics.median(times)


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """This machine's float32 matmul rate (GFLOP/s): the fastest of ``repeats`` n x n products after two
    warm-ups. The fastest, not the median: on a shared or frequency-scaling machine the median of a few
    products swings by 1.5x between runs, and a low rate would inflate every MFU divided by it."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def load_file(path: Path, name: str):
    """Import one file by path (flash-linear-attention's naive references need only torch and einops)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fla_file(rel: str):
    """A file of the installed flash-linear-attention package, without importing fla (which needs triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        return None
    try:
        return load_file(path, "fla_" + rel.replace("/", "_").removesuffix(".py"))
    except Exception as e:  # a peer that does not load is skipped, and said so
        print(f"  (could not load fla {rel}: {e})")
        return None


def fmt_ms(s) -> str:
    return "—" if s is None else (f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs")


def run_cases(cases: dict, lengths, repeats: int, budget: float, label: str = "T") -> list[dict]:
    """cases: name -> (make_inputs(T), fn(*inputs), max T forward, max T forward+backward).

    Forward runs under no_grad; forward+backward calls ``fn(*x).sum().backward()``. Sizes above a
    case's limits are skipped (None). The cases at one size run *interleaved*: round r times every
    case once, and each gets the median of its rounds. This machine's speed drifts by 2-3x over
    minutes (other tenants), so timing the cases one after the other skews ratios; interleaved rounds
    put every case through the same conditions. A case whose run takes longer than ``budget`` seconds
    stops after that run.
    """
    rows = []
    for T in lengths:
        for key, limit_at, reps in (("fwd", 2, repeats), ("fwdbwd", 3, max(1, repeats - 2))):
            live = {}
            for name, c in cases.items():
                if T <= c[limit_at]:
                    x = c[0](T)
                    if key == "fwdbwd":
                        x = [t.requires_grad_() if t.is_floating_point() else t for t in x]
                    fn = c[1]
                    live[name] = (lambda fn=fn, x=x: fn(*x)) if key == "fwd" else \
                        (lambda fn=fn, x=x: fn(*x).sum().backward())
            times = {name: [] for name in live}
            for r in range(reps + 1):                       # round 0 warms up
                for name, run in list(live.items()):
                    with torch.set_grad_enabled(key == "fwdbwd"):
                        t = time.perf_counter()
                        run()
                        dt = time.perf_counter() - t
                    if r or dt > budget:                    # a run slower than the budget counts, once
                        times[name].append(dt)
                    if dt > budget:
                        del live[name]
            gc.collect()
            for name in cases:
                row = next((x for x in rows if x[label] == T and x["impl"] == name), None)
                if row is None:
                    row = {label: T, "impl": name, "fwd": None, "fwdbwd": None}
                    rows.append(row)
                if times.get(name):
                    row[key] = statistics.median(times[name])
        for row in (x for x in rows if x[label] == T):
            print(f"  {label}={T:>6} {row['impl']:<28} fwd {fmt_ms(row['fwd']):>10}  "
                  f"fwd+bwd {fmt_ms(row['fwdbwd']):>10}", flush=True)
    return rows


def speed_tables(rows: list[dict], caption: str, label: str = "T") -> list[str]:
    """Markdown: one table for forward, one for forward+backward, implementations as rows."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    Ts = sorted({r[label] for r in rows})
    get = {(r[label], r["impl"]): r for r in rows}
    out = []
    for key, title in (("fwd", "Forward"), ("fwdbwd", "Forward + backward")):
        out += [f"**{title}** ({caption}; — = skipped: too slow or too large)", "",
                "| impl | " + " | ".join(f"{label}={T:,}" for T in Ts) + " |", "|---|" + "---|" * len(Ts)]
        for i in impls:
            out.append(f"| {i} | " + " | ".join(fmt_ms(get[(T, i)][key]) if (T, i) in get else "—" for T in Ts) + " |")
        out.append("")
    return out


def ratio(rows: list[dict], T: int, fast: str, slow: str, key: str, label: str = "T"):
    """How many times faster ``fast`` ran than ``slow`` at T (None if either was skipped)."""
    get = {(r[label], r["impl"]): r for r in rows}
    a, b = get.get((T, fast)), get.get((T, slow))
    if not a or not b or a[key] is None or b[key] is None:
        return None
    return b[key] / a[key]


def target_lines(targets: list[dict]) -> list[str]:
    return [f"- {t['what']}: {t['value']} (target {t['target']}) — **{'met' if t['met'] else 'not met'}**"
            for t in targets]


def parse_args(doc: str, argv=None, extra=None):
    """The options every benchmark takes (--quick, --out), and 2 threads as on the project's machine; ``extra``:
    a function adding a script's own options to the parser."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test")
    p.add_argument("--out", type=Path, default=OUT)
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    args.suffix = "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def cpu_model() -> str:
    """lscpu's model name (the machine changes between sessions: print it beside every table)."""
    import platform
    import subprocess

    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line(gflops: float | None = None) -> str:
    """One line for a table's caption: the CPU, the threads and the fp32 matmul rate measured now."""
    gflops = matmul_gflops(repeats=3) if gflops is None else gflops
    return f"{cpu_model()}, {torch.get_num_threads()} threads, fp32 matmul 2048² {gflops:.0f} GFLOP/s in this run"
