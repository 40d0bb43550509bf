"""`subquad serve` under load on loopback: throughput against concurrency, time to first token, state per
stream, a 10-turn chat with and without the prefix-state cache, and the server's memory over many requests.

    python benchmarks/bench_serve.py --quick          # a tiny model, a few seconds of load (a smoke run)
    python benchmarks/bench_serve.py                  # mamba-130m-shaped and a real-shape hybrid, random weights

The load generator is bounded: a fixed number of requests per measurement, two client threads (each an
asyncio loop over raw HTTP/1.0 streams: close-delimited server-sent events, no client library in the way),
and a wall-clock limit (--time-limit) after which it stops and reports what it has. The server runs in a
subprocess (``python -m subquad serve``) on 127.0.0.1.

Targets (issue 30): at 16 streams, aggregate tokens/s >= 6x one stream's (and >= llama.cpp's server under the
same load, with --llama-python and --llama-gguf); turn 10's time to first token within 1.5x of turn 1's with
the cache; 0 failed requests; RSS growth < 5% after warm-up. Each is reported met or missed with its number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def shapes(quick: bool) -> dict:
    from subquad.models import ModelConfig

    if quick:
        return {"tiny-mamba2": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, pattern="mamba2",
                                           mlp=False, mixer_options={"mamba2": {"norm_eps": 1e-6}})}
    return {  # mamba-130m (state-spaces/mamba-130m-hf) and a Bamba-shaped hybrid: Mamba-2 with 1 attention in 4
        "mamba-130m": ModelConfig(vocab_size=50280, d_model=768, n_layers=24, n_heads=12, pattern="mamba",
                                  mlp=False),
        "hybrid-mamba2-attn": ModelConfig(vocab_size=50280, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                                          pattern="mamba2*3,softmax,mamba2*3,softmax,mamba2*3,softmax",
                                          mixer_options={"softmax": {"rotary_fraction": 0.5},
                                                         "mamba2": {"norm_eps": 1e-6}})}


def write_folder(cfg, path: Path) -> Path:
    import torch

    from subquad.models import LanguageModel

    torch.manual_seed(0)
    LanguageModel(cfg).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``subquad serve --model folder *args`` on 127.0.0.1 (or, with ``command``, another server taking
    ``--port``), up once ``ready`` answers."""

    def __init__(self, folder: Path, *args, command=None, ready="/health"):
        self.port = free_port()
        self.name = folder.name
        command = command or [sys.executable, "-m", "subquad", "serve", "--model", str(folder)]
        self.proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port), *map(str, args)],
                                     cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"})
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}{ready}", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the server did not come up")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def one_request(port: int, body: dict) -> dict:
    """One streamed completion over HTTP/1.0: {ok, ttft, tokens, ids, seconds}; ``ids`` the generated token ids
    when the body asks for ``logprobs`` (a model without a tokenizer names its tokens "token_id:N")."""
    t0 = time.perf_counter()
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    ok, ttft, tokens, ids, chunks, text = False, None, 0, [], 0, ""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        status = (await reader.readline()).split()
        ok = len(status) > 1 and status[1] == b"200"
        if not ok:
            print(f"  request failed: {b' '.join(status).decode(errors='replace')} "
                  f"{(await reader.read(400)).decode(errors='replace')!r}", file=sys.stderr, flush=True)
        while (await reader.readline()).strip():           # headers
            pass
        async for line in reader:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            chunks += any(c.get("text") or not c.get("finish_reason") for c in chunk.get("choices", []))
            text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
            for c in chunk.get("choices", []):
                ids += [int(t.split(":")[1]) for t in ((c.get("logprobs") or {}).get("tokens") or [])]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        writer.close()
    except OSError:
        ok = False
    # a server that sends no usage while streaming (llama-cpp-python's) streams one token a chunk, then one
    # that holds only the finish reason
    return {"ok": ok and ttft is not None, "ttft": ttft, "tokens": tokens or chunks, "ids": ids, "text": text,
            "seconds": time.perf_counter() - t0}


def load(port: int, bodies: list, concurrency: int, deadline: float) -> list:
    """Run ``bodies`` with ``concurrency`` in flight, split over two client threads; stop at ``deadline``."""
    results, lock = [], threading.Lock()
    todo = list(bodies)

    def thread(width):
        async def worker():
            while time.monotonic() < deadline:
                with lock:
                    if not todo:
                        return
                    body = todo.pop()
                r = await one_request(port, body)
                with lock:
                    results.append(r)

        async def main():
            await asyncio.gather(*(worker() for _ in range(width)))

        asyncio.run(main())

    widths = [w for w in (concurrency - concurrency // 2, concurrency // 2) if w]
    threads = [threading.Thread(target=thread, args=(w,)) for w in widths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pct(values, q):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def throughput(server, name, make_body, a, deadline, concurrency) -> tuple:
    """Aggregate generated tokens/s and time to first token at each concurrency (``a.rounds`` requests per
    stream, ``c`` in flight); and the failed requests."""
    out, failed = {}, 0
    for c in concurrency:
        t = time.perf_counter()
        res = load(server.port, [make_body() for _ in range(a.rounds * c)], c, deadline)
        wall = time.perf_counter() - t
        failed += sum(not r["ok"] for r in res)
        out[c] = {"tokens_per_s": sum(r["tokens"] for r in res) / wall, "requests": len(res),
                  "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in res], 0.5),
                  "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in res], 0.99)}
        print(f"  {name} c={c}: {out[c]}", flush=True)
    return out, failed


def measure(name, folder, cfg, a, deadline) -> dict:
    from subquad.models import LanguageModel
    from subquad.serve import Engine

    rng = random.Random(0)
    V = cfg.vocab_size
    prompt = lambda n: [rng.randrange(V) for _ in range(n)]          # noqa: E731
    out = {"model": name, "failed": 0, "throughput": {}}
    server = Server(folder, "--max-batch", max(a.concurrency), "--max-queue", 4 * max(a.concurrency),
                    "--max-context", a.context, "--served-model-name", name, *a.serve_args)
    try:
        body = lambda n=a.prompt_tokens, m=a.max_tokens: {"model": name, "prompt": prompt(n),   # noqa: E731
                                                          "max_tokens": m, "temperature": 0}
        load(server.port, [body() for _ in range(2)], 2, deadline)                    # warm-up
        if "throughput" in a.parts:
            out["throughput"], out["failed"] = throughput(server, name, body, a, deadline, a.concurrency)
        # memory over many requests: short ones (a 16-token prompt, 8 new tokens), 16 in flight
        short = lambda: body(16, 8)                                                   # noqa: E731
        n, rss0, t = a.requests, server.rss_mb(), time.perf_counter()
        warm = max(1, n // 10)
        res = load(server.port, [short() for _ in range(warm)], 16, deadline)
        rss_warm = server.rss_mb()
        res += load(server.port, [short() for _ in range(n - warm)], 16, deadline)
        out["failed"] += sum(not r["ok"] for r in res) + (n - len(res))       # unsent (past the deadline) fail
        out["rss"] = {"before_mb": rss0, "after_warmup_mb": rss_warm, "after_mb": server.rss_mb(),
                      "requests": len(res), "seconds": time.perf_counter() - t}
        print(f"  {name} rss: {out['rss']}", flush=True)
    finally:
        server.stop()
    model = LanguageModel(cfg).eval()
    engine = Engine(model, max_context=a.context)
    out["state_bytes_per_stream"] = {T: engine.row_bytes(T) for T in sorted({min(1024, a.context), a.context})}
    hd = cfg.d_model // cfg.n_heads
    kv = cfg.n_layers * 2 * (cfg.n_kv_heads or cfg.n_heads) * hd * 4     # a transformer of this width, every layer
    out["transformer_kv_bytes"] = {T: kv * T for T in sorted({min(1024, a.context), a.context})}
    turns = [prompt(a.turn_tokens) for _ in range(10)]                 # the same chat with and without the cache
    warm = [(turns[0][0] + 1) % V] + prompt(a.turn_tokens - 1)         # shares no prefix with it
    out["chat"] = {}
    for cache_mb in (256, 0):
        server = Server(folder, "--max-context", a.context, "--state-cache-mb", cache_mb, "--served-model-name", name,
                        *a.serve_args)
        try:
            out["chat"]["cached" if cache_mb else "uncached"], failed = chat(server, name, turns, warm)
            out["failed"] += failed
        finally:
            server.stop()
    return out


def chat(server, name, turns, warm) -> tuple:
    """Time to first token of each turn of a 10-turn chat whose prompt is the whole history (the turns and the
    answers); prompts are token ids, or text for a server that does not take the folder's ids (llama.cpp's,
    whose answers come back as text)."""
    # one request first: turn 1 must not pay the server's first-request costs (allocator, lazy imports)
    failed = not asyncio.run(one_request(server.port, {"model": name, "prompt": warm, "max_tokens": 8,
                                                       "temperature": 0}))["ok"]
    history, ttfts = type(warm)(), []
    for turn in turns:
        history += turn
        body = {"model": name, "prompt": history, "max_tokens": 8, "temperature": 0}
        r = asyncio.run(one_request(server.port, body if isinstance(history, str) else {**body, "logprobs": 0}))
        failed += not r["ok"]
        ttfts.append(r["ttft"])
        history += r["text"] if isinstance(history, str) else r["ids"]    # the answer, as the next turn holds it
    return ttfts, failed


# llama.cpp's comparison: the GGUF of the same folder (GPT-NeoX's vocabulary, which its converter gives a mamba
# folder without a tokenizer), prompts as text of common words (one token each) of the same lengths
WORDS = ("the of and to in is was for on as with by at from his her that this which were are be had not have "
         "one all two new first time after year years also city state world may would more most other some "
         "these than into only over such made like when where there their people during school").split()


def gguf_of(folder: Path, llama_src: str) -> Path:
    gguf = folder.with_suffix(".f32.gguf")
    conv = subprocess.run([sys.executable, str(Path(llama_src) / "convert_hf_to_gguf.py"), str(folder),
                           "--outfile", str(gguf), "--outtype", "f32"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(llama_src) / "gguf-py")})
    if conv.returncode:
        raise RuntimeError("convert_hf_to_gguf.py: " + conv.stderr[-2000:])
    return gguf


def measure_llama(name, folder, a, deadline) -> dict:
    """The same load against llama-cpp-python's server (``python -m llama_cpp.server``, 2 threads), which runs
    one request at a time: concurrent streams queue (with ``interrupt_requests`` off; on, its default, each new
    request ends the one streaming)."""
    rng = random.Random(0)
    text = lambda n: " " + " ".join(rng.choice(WORDS) for _ in range(n))      # noqa: E731
    gguf = gguf_of(folder, a.llama_src)
    out = {"model": f"{name} (llama.cpp server, f32 GGUF)", "failed": 0}
    command = [a.llama_python, "-m", "llama_cpp.server", "--model", str(gguf)]
    # twice the context: the chat's answers come back as text, and re-tokenised they can take more tokens;
    # interrupt_requests off: by default a new request cuts the streaming one short (its tokens never come)
    args = ("--n_threads", 2, "--n_threads_batch", 2, "--n_ctx", 2 * a.context, "--interrupt_requests", "False")
    try:
        server = Server(folder, *args, command=command, ready="/v1/models")
        try:
            body = lambda: {"model": name, "prompt": text(a.prompt_tokens), "max_tokens": a.max_tokens,  # noqa: E731
                            "temperature": 0}
            load(server.port, [body() for _ in range(2)], 2, deadline)
            out["throughput"], out["failed"] = throughput(server, out["model"], body, a, deadline,
                                                          [c for c in a.concurrency if c <= 16])
        finally:
            server.stop()
        server = Server(folder, *args, command=command, ready="/v1/models")
        try:
            out["chat"] = {}
            out["chat"]["uncached"], failed = chat(server, name, [text(a.turn_tokens) for _ in range(10)],
                                                   text(a.turn_tokens))
            out["failed"] += failed
        finally:
            server.stop()
    finally:
        gguf.unlink(missing_ok=True)
    return out


def report(results: list, llama: dict | None) -> str:
    lines = []
    for r in results:
        tp = r["throughput"]
        ll = llama if llama and llama["model"].startswith(r["model"] + " ") else None
        lines.append(f"\n## {r['model']}\n\n| streams | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | requests |"
                     + (" llama.cpp server: tokens/s | TTFT p50 | TTFT p99 |" if ll else "")
                     + "\n|---|---|---|---|---|" + ("---|---|---|" if ll else ""))
        for c, v in tp.items():
            row = f"| {c} | {v['tokens_per_s']:.1f} | {v['ttft_p50_ms']:.1f} | {v['ttft_p99_ms']:.1f} | {v['requests']} |"
            if ll:
                w = ll["throughput"].get(c)
                row += (f" {w['tokens_per_s']:.1f} | {w['ttft_p50_ms']:.1f} | {w['ttft_p99_ms']:.1f} |" if w
                        else " - | - | - |")
            lines.append(row)
        sb, kv = r["state_bytes_per_stream"], r["transformer_kv_bytes"]
        lines.append("\nstate per stream: " + ", ".join(f"{sb[T]:,} B at {T} tokens (a transformer's KV cache: "
                                                       f"{kv[T]:,} B)" for T in sb))
        ch = r["chat"]
        c1, c10 = ch["cached"][0], ch["cached"][-1]
        u1, u10 = ch["uncached"][0], ch["uncached"][-1]
        lines.append(f"10-turn chat TTFT (ms): cached turn 1 {1e3 * c1:.1f}, turn 10 {1e3 * c10:.1f} "
                     f"(x{c10 / c1:.2f}); uncached turn 1 {1e3 * u1:.1f}, turn 10 {1e3 * u10:.1f} (x{u10 / u1:.2f})")
        if ll:
            l1, l10 = ll["chat"]["uncached"][0], ll["chat"]["uncached"][-1]
            lines.append(f"llama.cpp server, the same chat as text: turn 1 {1e3 * l1:.1f}, turn 10 {1e3 * l10:.1f} "
                         f"(x{l10 / l1:.2f}); its failed requests: {ll['failed']}")
        rss = r["rss"]
        growth = (rss["after_mb"] - rss["after_warmup_mb"]) / rss["after_warmup_mb"]
        lines.append(f"RSS: {rss['before_mb']:.0f} MB before, {rss['after_warmup_mb']:.0f} after warm-up, "
                     f"{rss['after_mb']:.0f} after {rss['requests']} requests ({100 * growth:+.1f}%, "
                     f"{rss['seconds']:.0f} s)")
        ratio = tp[16]["tokens_per_s"] / tp[1]["tokens_per_s"] if 16 in tp and 1 in tp else None
        top = 16 if 16 in tp or not tp else max(tp)                 # the target's concurrency (--quick: its top)
        vs = tp[top]["tokens_per_s"] / ll["throughput"][top]["tokens_per_s"] if ll and top in ll["throughput"] else None
        targets = [("16 streams >= 6x one stream", ratio is not None and ratio >= 6,
                    "n/a" if ratio is None else f"x{ratio:.2f}"),
                   ("turn 10 TTFT <= 1.5x turn 1 (cached)", c10 / c1 <= 1.5, f"x{c10 / c1:.2f}"),
                   ("0 failed requests", r["failed"] == 0, str(r["failed"])),
                   ("RSS growth < 5% after warm-up", growth < 0.05, f"{100 * growth:+.1f}%")]
        if ll:
            targets.append((f"{top} streams >= llama.cpp's server at {top}", vs is not None and vs >= 1,
                            "n/a" if vs is None else f"x{vs:.2f}"))
        lines += [f"- {name}: {'not measured' if num == 'n/a' else 'met' if ok else 'MISSED'} ({num})"
                  for name, ok, num in targets]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model and little load (a smoke run)")
    p.add_argument("--out", default="runs/bench_serve.json", help="results as JSON")
    p.add_argument("--time-limit", type=float, default=None, help="wall-clock seconds for the whole load")
    p.add_argument("--llama-python", help="a Python with llama-cpp-python[server], for llama.cpp's comparison")
    p.add_argument("--llama-src", help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py), which converts "
                                       "the mamba-130m-shaped folder to a float32 GGUF for --llama-python")
    p.add_argument("--models", help="comma-separated names among " + ", ".join(shapes(False)))
    p.add_argument("--serve-args", default="", help="more `subquad serve` flags, e.g. '--compile-decode'")
    p.add_argument("--skip-throughput", action="store_true",
                   help="measure only memory over --requests, state bytes and the chat (a rerun of those)")
    p.add_argument("--requests", type=int, help="requests of the memory measurement (default 5,000; --quick 40)")
    a = p.parse_args(argv)
    a.concurrency = [1, 4] if a.quick else [1, 4, 16, 64]
    a.rounds = 2 if a.quick else 4
    a.requests = a.requests or (40 if a.quick else 5000)
    a.parts = () if a.skip_throughput else ("throughput",)
    a.prompt_tokens, a.max_tokens = (16, 16) if a.quick else (128, 128)
    a.turn_tokens = 16 if a.quick else 128
    a.context = 512 if a.quick else 4096
    deadline = time.monotonic() + (a.time_limit or (120 if a.quick else 3600))
    a.serve_args = a.serve_args.split()
    import torch

    from benchmarks.common import machine_line

    torch.set_num_threads(2)
    machine = machine_line()
    print(machine, flush=True)
    if bool(a.llama_python) != bool(a.llama_src):
        p.error("--llama-python and --llama-src go together")
    wanted = shapes(a.quick)
    if a.models:
        unknown = set(a.models.split(",")) - set(wanted)
        if unknown:
            p.error(f"--models: unknown {sorted(unknown)}; choose among {sorted(wanted)}")
        wanted = {k: v for k, v in wanted.items() if k in a.models.split(",")}
    results, llama = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in wanted.items():
            folder = write_folder(cfg, Path(tmp) / name)
            if a.llama_python and (name == "mamba-130m" or a.quick):
                llama = measure_llama(name, folder, a, deadline)
            results.append(measure(name, folder, cfg, a, deadline))
    text = machine + "\n" + report(results, llama)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine, "results": results, "llama.cpp": llama}, indent=1,
                                      default=str))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
