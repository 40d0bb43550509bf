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
from subquad.train.checkpoint import latest_checkpoint, load_checkpoint
from subquad.train.trainer import TrainConfig, Trainer


def train_run(model_cfg: ModelConfig, train_cfg: TrainConfig, out, data: str | None = None, resume: bool = False,
              vocab_size: int | None = None, progress: bool = True, log=print, token_data=None,
              device="cpu") -> dict:
    """Train (or with ``resume`` continue) the run in ``out`` on ``device`` (``subquad.device``: 'auto',
    'cpu', 'cuda', ...). The model is built on the CPU from the seed, then moved, so every device
    starts from the same weights."""
    from subquad.train.trainer import _dist

    device = resolve_device(device)
    rank, world = _dist()
    if rank != 0:
        log = lambda m: None                                   # noqa: E731  (rank 0 speaks for the run)
    out = Path(out)
    if out.exists() and latest_checkpoint(out) is not None and not resume:
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
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        shutil.copyfile(td.tokenizer_path, out / "tokenizer.json")
        (out / "manifest.json").write_text(json.dumps(td.manifest, indent=1))
        (out / "config.json").write_text(json.dumps({"model": model_cfg.to_dict(), "train": asdict(train_cfg),
                                                     "data": data or "stdlib", "world": world}, indent=1))
    torch.manual_seed(train_cfg.seed)
    model = LanguageModel(model_cfg).to(device)
    trainer = Trainer(model, td, train_cfg, out, progress=progress and rank == 0)
    if resume and trainer.resume():
        log(f"resuming {out} from step {trainer.step}")
    log(f"{out.name}: {model_cfg.pattern} x{model_cfg.n_layers}, {model.num_parameters():,} parameters, "
        f"{train_cfg.steps} steps of {train_cfg.batch_size} x {model_cfg.context_length} tokens")
    result = trainer.fit(log=log)
    result["parameters"] = model.num_parameters()
    return result


def load_run(path, device="cpu"):
    """(model in eval mode on ``device``, tokenizer, meta) from a run folder or a checkpoint folder."""
    from subquad.data.tokenizer import load_tokenizer

    path = Path(path)
    model_sd, _, meta = load_checkpoint(path)
    model = LanguageModel(ModelConfig.from_dict(meta["model_config"]))
    model.load_state_dict(model_sd)
    model.to(resolve_device(device)).eval()
    run = path if (path / "ckpt").exists() else path.parent.parent
    return model, load_tokenizer(run / "tokenizer.json"), meta
