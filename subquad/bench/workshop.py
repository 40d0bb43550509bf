"""The workshop: the plate "Beyond Quadratic Attention", reproduced on this machine.

  1. linear attention (elu+1) computed in parallel and recurrently over 32 random
     tokens in float64, and the largest difference (the plate: 4.4e-16);
  2. memory per layer and head of a KV cache against a linear state, d = 32;
  3. two training runs of micro's shape on the embedded corpus - softmax attention
     against linear attention (elu+1), everything else equal - and their held-out
     loss curves, final losses and gap (``--seeds N`` repeats both with other seeds
     and reports the gap with its seed-to-seed spread);
  4. a PNG (memory against context, log-log | held-out loss against step) and a
     JSON of every number in --out.

The plate trained 6,000 steps (softmax 4.208, linear 4.268 nats, gap 0.060) on
another corpus: compare the gap, not the absolute values. The default 600 steps
take about 12 minutes on 2 cores (benchmarks/RESULTS.md, "The workshop").
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from subquad.bench import memory, plots
from subquad.bench.table import fmt_bytes, render


def parallel_vs_recurrent(T: int = 32, head_dim: int = 32, seed: int = 0) -> float:
    """Largest |parallel - recurrent| of normalised elu+1 linear attention, float64, one head."""
    from subquad.ops import feature_map, linear_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, 1, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    phi = feature_map("elu+1")
    o_par, _ = linear_attention(phi(q), phi(k), v, mode="parallel")
    o_rec, _ = linear_attention(phi(q), phi(k), v, mode="recurrent")
    return (o_par - o_rec).abs().max().item()


def run_config(name: str, steps: int = 600, seed: int = 0, positions: str = "rope", batch_size: int = 16):
    """One workshop run's (ModelConfig, TrainConfig): micro's shape with ``name`` ("softmax" or "linear") as
    every mixer. The held-out loss is measured every ``steps // 12`` steps and at the end, on the same windows
    drawn by their own generator, so how often it is measured changes no loss (the README's check run in
    tests/bench/test_workshop_readme.py measures it only at the end)."""
    from subquad.models import micro
    from subquad.train import TrainConfig

    if positions not in ("rope", "learned"):
        raise ValueError(f"positions must be 'rope' or 'learned', got {positions!r}")
    cfg = TrainConfig(steps=steps, batch_size=batch_size, seed=seed, eval_every=max(1, steps // 12),
                      ckpt_every=max(1, steps // 4), warmup=min(50, max(1, steps // 10)))
    if positions == "learned":
        mcfg = micro(pattern=name, pos_emb="learned", mixer_options={"softmax": {"rotary": False}})
    else:
        mcfg = micro(pattern=name)
    return mcfg, cfg


def training_runs(out: Path, steps: int, seeds: int, data=None, batch_size: int = 16, progress: bool = True,
                  positions: str = "rope", log=print) -> dict:
    """Softmax against linear attention (elu+1) at micro's shape; one pair of runs per seed.

    positions="rope": each mixer as it is used today - rotary positions inside softmax attention,
    none for linear attention (causal and recurrent, it needs none). positions="learned": both get the
    same learned absolute position embedding and softmax no rotary (the 2020 setting).
    """
    if positions not in ("rope", "learned"):
        raise ValueError(f"positions must be 'rope' or 'learned', got {positions!r}")
    from subquad.data.dataset import prepare

    td = prepare(data, 4096, log=log)
    runs: dict = {"softmax": [], "linear": []}
    for seed in range(seeds):
        for name in ("softmax", "linear"):
            mcfg, cfg = run_config(name, steps, seed, positions, batch_size)
            r = _train_or_reuse(mcfg, cfg, out / f"{name}_{positions}_seed{seed}", data, progress, log, td)
            runs[name].append(r)
            log(f"      {name:<8} seed {seed}: held-out loss {r['heldout_loss']:.4f} after {r['steps']} steps")
    final = {n: [r["heldout_loss"] for r in rs] for n, rs in runs.items()}
    gaps = [lin - soft for soft, lin in zip(final["softmax"], final["linear"])]
    mean = sum(gaps) / len(gaps)
    spread = (sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)) ** 0.5 if len(gaps) > 1 else None
    return {"steps": steps, "seeds": seeds, "positions": positions, "final": final, "gaps": gaps, "gap_mean": mean, "gap_std": spread,
            "curves": {n: [r["curve"] for r in rs] for n, rs in runs.items()},
            "parameters": runs["softmax"][0]["parameters"], "manifest_sha256": td.manifest["sha256"],
            "python": td.manifest["python"]}


def run(out: str | Path = "runs/workshop", head_dim: int = 32, contexts=None, seed: int = 0, steps: int = 600,
        seeds: int = 1, data=None, train: bool = True, progress: bool = True, positions: str = "rope") -> dict:
    t0 = time.time()
    out = Path(out)
    if train:
        _refuse_other_positions(out, positions)
    out.mkdir(parents=True, exist_ok=True)
    contexts = contexts or [1024, 4096, 16384, 65536, 131072, 262144, 1048576]
    total = 4 if train else 3

    diff = parallel_vs_recurrent(32, head_dim, seed)
    print(f"[1/{total}] linear attention (elu+1), 32 random tokens, d={head_dim}, float64:")
    print(f"      max |parallel - recurrent| = {diff:.2e}   (the plate: 4.4e-16; rounding error)")

    rows = memory.analytic(contexts, head_dim, "float32")
    print(f"\n[2/{total}] memory per layer and head, d={head_dim} (numbers; bytes in float32):")
    print(render([{"context": f"{r['context']:,}", "KV cache 2Td": f"{r['kv_numbers']:,}",
                   "state d²+d": f"{r['state_numbers']:,}", "KV bytes": fmt_bytes(r["kv_bytes"]),
                   "state bytes": fmt_bytes(r["state_bytes"]), "KV/state": f"{r['ratio']:,.0f}x"} for r in rows]))
    measured = memory.measure([1024, 4096, 16384], head_dim, "float32")
    print("      measured from the tensors the ops keep:",
          ", ".join(f"T={m['context']:,}: KV {fmt_bytes(m['kv_cache_bytes'])}, state {fmt_bytes(m['state_bytes'])}"
                    for m in measured))
    result = {"parallel_vs_recurrent_max_abs_diff": diff, "head_dim": head_dim, "memory_analytic": rows,
              "memory_measured": measured, "torch": torch.__version__, "python": platform.python_version()}

    curves = None
    if train:
        pos = {"rope": "rotary positions in softmax, none in linear",
               "learned": "learned absolute positions in both"}[positions]
        print(f"\n[3/{total}] training micro (d_model 128, 4 layers, 4 heads of 32, context 256): softmax vs "
              f"linear (elu+1), {pos}, {steps} steps x {seeds} seed(s) on {data or 'the Python stdlib corpus'}")
        tr = training_runs(out, steps, seeds, data, progress=progress, positions=positions,
                           log=lambda m: print("      " + m))
        result["training"] = tr
        curves = {}
        for name in ("softmax", "linear"):
            pts = tr["curves"][name]
            steps_axis = [p[0] for p in pts[0]]
            mean_curve = [sum(c[i][1] for c in pts) / len(pts) for i in range(len(steps_axis))]
            curves[f"{name} ({'elu+1' if name == 'linear' else 'attention'})"] = list(zip(steps_axis, mean_curve))
        soft, lin = tr["final"]["softmax"], tr["final"]["linear"]
        print(f"      final held-out loss: softmax {sum(soft) / len(soft):.3f}, linear {sum(lin) / len(lin):.3f} nats;"
              f" gap {tr['gap_mean']:+.3f}" + (f" ± {tr['gap_std']:.3f} (std over {seeds} seeds)" if tr["gap_std"] else "")
              + "   (the plate, 6,000 steps: 4.208 vs 4.268, gap +0.060)")

    png = out / "workshop.png"
    plots.workshop_figure(png, rows, head_dim, "float32", curves)
    result["seconds"] = round(time.time() - t0, 1)
    (out / "workshop.json").write_text(json.dumps(result, indent=2))
    print(f"\n[{total}/{total}] wrote {png} and {out / 'workshop.json'} ({result['seconds']} s)")
    return result


def _refuse_other_positions(out: Path, positions: str) -> None:
    """A workshop's runs are named by their positions, so another --positions would train beside them and
    overwrite the workshop.json and workshop.png of the first: refused by name, as other --steps or --data are
    - found in workshop.json, or, for a workshop stopped before writing it, in its runs' folder names."""
    had = None
    try:
        had = json.loads((out / "workshop.json").read_text()).get("training", {}).get("positions")
    except (OSError, ValueError, AttributeError):
        pass
    if had is None:
        had = next((other for other in ("rope", "learned") if other != positions
                    and any((out / f"{name}_{other}_seed0").is_dir() for name in ("softmax", "linear"))), None)
    if had is not None and had != positions:
        raise ValueError(f"{out} holds a workshop of --positions {had} (its workshop.json); --positions {positions} "
                         f"would overwrite its results: give another --out")


def _train_or_reuse(mcfg, cfg, run, data, progress, log, td):
    """Train the run, continue it if a rerun finds it part-way, or reuse it if it is complete - only a run of
    these very settings (its schedule's length, model, data): one of others is refused by name, never reported
    as this workshop's."""
    from subquad.train import train_run
    from subquad.train.checkpoint import latest_checkpoint, verify_checkpoint
    from subquad.train.run import read_run_config, resume_differences, schedule_of

    if (run / "config.json").exists():
        saved = read_run_config(run)
        diffs = resume_differences(saved, mcfg, cfg, data)
        if schedule_of(saved) != cfg.steps:
            diffs.insert(0, f"steps: {cfg.steps} (the run has {schedule_of(saved)})")
        if diffs:
            raise ValueError(f"{run} is a workshop run of other settings ({'; '.join(diffs)}): give another --out, "
                             f"or delete {run.parent} to train afresh")
    ck = latest_checkpoint(run) if (run / "config.json").exists() else None
    if ck is not None:
        meta = verify_checkpoint(ck)
        if meta["step"] >= cfg.steps and meta.get("curve"):
            from subquad.models import LanguageModel, ModelConfig

            model = LanguageModel(ModelConfig.from_dict(meta["model_config"]))   # its vocab: the run's tokenizer's
            return {"steps": meta["step"], "heldout_loss": meta["curve"][-1][1], "curve": meta["curve"],
                    "parameters": model.num_parameters()}
    return train_run(mcfg, cfg, run, data=data, resume=(run / "config.json").exists(), progress=progress,
                     log=log, token_data=td)

