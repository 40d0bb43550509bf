"""A training run on disk: what `subquad train` and the workshop call.

    runs/NAME/config.json      model, training and data settings
    runs/NAME/tokenizer.json   the BPE the run was trained with
    runs/NAME/manifest.json    corpus manifest (Python version, files, sha256)
    runs/NAME/metrics.jsonl    one line per step (held-out loss every eval_every)
    runs/NAME/ckpt/            atomic checkpoints, ckpt/latest names the newest
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from subquad.data.dataset import prepare
from subquad.device import resolve_device
from subquad.models import LanguageModel, ModelConfig
from subquad.train.checkpoint import has_checkpoints, load_checkpoint, write_atomic
from subquad.train.trainer import TrainConfig, Trainer


RESUME_SAFE = ("steps", "eval_every", "ckpt_every", "eval_batches")   # what a resume may change


def read_run_config(out) -> dict:
    """The run's own config.json: {"model", "train", "data", "world"}; ValueError when there is no run."""
    path = Path(out) / "config.json"
    if not path.exists():
        raise ValueError(f"{out} holds no run to resume (no config.json there)")
    try:
        cfg = json.loads(path.read_text())
        cfg["train"].setdefault("pack", False)      # runs from before packing trained on the concatenated stream
        ModelConfig.from_dict(cfg["model"])
        TrainConfig(**cfg["train"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a run config ({e})") from None
    return cfg


def resume_differences(saved: dict, model_cfg: ModelConfig, train_cfg: TrainConfig, data) -> list[str]:
    """What would change the model, the data or the training if a run saved as ``saved`` continued with
    these settings: one 'name: given (the run has saved)' per difference; empty when the resume is safe."""
    out = []
    for name, value in model_cfg.to_dict().items():
        if name != "vocab_size" and saved["model"].get(name) != value:        # vocab: the tokenizer's
            out.append(f"{name}: {value!r} (the run has {saved['model'].get(name)!r})")
    default = asdict(TrainConfig())
    for name, value in asdict(train_cfg).items():
        have = saved["train"].get(name, default[name])
        if name not in RESUME_SAFE and have != value:
            out.append(f"{name}: {value!r} (the run has {have!r})")
    if (data or "stdlib") != saved.get("data", "stdlib"):
        out.append(f"data: {data or 'stdlib'!r} (the run has {saved.get('data')!r})")
    return out


def train_run(model_cfg: ModelConfig, train_cfg: TrainConfig, out, data: str | None = None, resume: bool = False,
              vocab_size: int | None = None, progress: bool = True, log=print, token_data=None,
              device="cpu") -> dict:
    """Train (or with ``resume`` continue) the run in ``out`` on ``device`` (``subquad.device``: 'auto',
    'cpu', 'cuda', ...). The model is built on the CPU from the seed, then moved, so every device
    starts from the same weights.

    A resume must name settings equal to the run's own (``read_run_config``; ``subquad train --resume``
    reads them for you): only ``RESUME_SAFE`` fields may differ, ``steps`` must pass the checkpoint's
    step, and nothing in the run folder is written until the checkpoint has loaded. A fresh run that
    fails before its first step leaves no folder behind."""
    from subquad.train.trainer import _dist

    device = resolve_device(device)
    rank, world = _dist()
    if rank != 0:
        log = lambda m: None                                   # noqa: E731  (rank 0 speaks for the run)
    out = Path(out)
    saved = None
    if resume:
        saved = read_run_config(out)
        diff = resume_differences(saved, model_cfg, train_cfg, data)
        if diff:
            raise ValueError(f"--resume would change the run in {out}: " + "; ".join(diff) +
                             ". Drop those flags (the run's own settings are used) or start a new --out")
    elif out.exists() and has_checkpoints(out):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    if world > 1 and token_data is None:
        import torch.distributed as dist
        if rank == 0:                                          # rank 0 builds the token cache, then the rest read it
            token_data = prepare(data, vocab_size or model_cfg.vocab_size, log=log)
        dist.barrier()
    td = token_data or prepare(data, vocab_size or model_cfg.vocab_size, log=log)
    vocab = td.tokenizer().get_vocab_size()
    if vocab != model_cfg.vocab_size:
        model_cfg = ModelConfig.from_dict({**model_cfg.to_dict(), "vocab_size": vocab})
    torch.manual_seed(train_cfg.seed)
    model = LanguageModel(model_cfg).to(device)                # bad mixer options fail here, before any write
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(model, td, train_cfg, out, progress=progress and rank == 0)
        if resume:
            if not trainer.resume(log=log, trim_metrics=False):
                log(f"{out} has no checkpoint yet: starting it from step 0")
            elif trainer.step >= train_cfg.steps:
                raise ValueError(f"the run in {out} is at step {trainer.step} already; pass --steps above it "
                                 "to train further")
            else:
                log(f"resuming {out} from step {trainer.step}")
                if rank == 0:
                    trainer._trim_metrics()
        if rank == 0:
            if not resume:
                shutil.copyfile(td.tokenizer_path, out / "tokenizer.json")
                write_atomic(out / "manifest.json", json.dumps(td.manifest, indent=1))
            write_atomic(out / "config.json", json.dumps({"model": model_cfg.to_dict(), "train": asdict(train_cfg),
                                                          "data": data or "stdlib", "world": world}, indent=1))
    except BaseException:
        if created and rank == 0:                             # nothing trained: no half-made run folder
            shutil.rmtree(out, ignore_errors=True)
        raise
    log(f"{out.name}: {model_cfg.pattern} x{model_cfg.n_layers}, {model.num_parameters():,} parameters, "
        f"{train_cfg.steps} steps of {train_cfg.batch_size} x {model_cfg.context_length} tokens"
        f"{', packed at document starts' if trainer.eot is not None else ''}")
    result = trainer.fit(log=log)
    result["parameters"] = model.num_parameters()
    return result


def load_run(path, device="cpu", quantize=None):
    """(model in eval mode on ``device``, tokenizer, meta) from a run folder or a checkpoint folder;
    ``quantize`` "int8" or "bf16" quantises its projections for inference (``models.quant``)."""
    from subquad.data.tokenizer import load_tokenizer

    path = Path(path)
    model_sd, _, meta = load_checkpoint(path)
    model = LanguageModel(ModelConfig.from_dict(meta["model_config"]))
    model.load_state_dict(model_sd)
    if quantize is not None:
        from subquad.models.quant import quantize as quantize_model

        quantize_model(model, quantize)
    model.to(resolve_device(device)).eval()
    run = path if (path / "ckpt").exists() else path.parent.parent
    return model, load_tokenizer(run / "tokenizer.json"), meta
