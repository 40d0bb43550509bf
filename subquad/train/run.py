"""A training run on disk: what `subquad train` and the workshop call.

    runs/NAME/config.json      model, training and data settings; the sha256 of the corpus and tokenizer
    runs/NAME/tokenizer.json   the BPE the run was trained with
    runs/NAME/manifest.json    corpus manifest (Python version, files, sha256): a resume on other data is refused
    runs/NAME/metrics.jsonl    one line per step (held-out loss every eval_every)
    runs/NAME/ckpt/            atomic checkpoints; the newest intact one by step is used (ckpt/latest: a hint)
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

import torch

from subquad.data.dataset import prepare
from subquad.device import resolve_device
from subquad.models import LanguageModel, ModelConfig
from subquad.train.checkpoint import has_checkpoints, load_checkpoint, write_atomic, wrote_checkpoints
from subquad.train.parallelize import make_mesh, parallelize
from subquad.train.trainer import TrainConfig, Trainer, config_difference


# what a resume may change: the schedule's bookkeeping, and how the same math is laid out on processes
RESUME_SAFE = ("steps", "eval_every", "ckpt_every", "eval_batches", "fsdp", "replicate", "activation_checkpointing",
               "context_parallel")


def read_run_config(out) -> dict:
    """The run's own config.json: {"model", "train", "data", "world", ...}; ValueError when there is no run."""
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
    these settings: one 'name: given (the run has saved)' per difference; empty when the resume is safe.
    ``schedule_steps`` None means the run's own."""
    out = []
    for name, value in model_cfg.to_dict().items():
        have = saved["model"].get(name)
        if name == "pattern" and same_layers(value, have, model_cfg.n_layers):
            continue                                                          # 'a,a,b' is 'a*2,b'
        if name != "vocab_size" and have != value:                            # vocab: the tokenizer's
            out.append(f"{name}: {value!r} (the run has {have!r})")
    out += train_differences(saved["train"], train_cfg)
    if not same_data(data or "stdlib", saved.get("data", "stdlib")):
        out.append(f"data: {data or 'stdlib'!r} (the run has {saved.get('data')!r})")
    return out


def same_layers(pattern, other, n_layers: int) -> bool:
    """Whether two patterns spell the same stack of mixers (``mamba2*3,softmax`` and its four names)."""
    from subquad.models.config import parse_pattern

    try:
        return parse_pattern(pattern, n_layers) == parse_pattern(other, n_layers)
    except (ValueError, TypeError, AttributeError):
        return False


def train_differences(saved_train: dict, train_cfg: TrainConfig, schedule: bool = True, has: str = "the run has"
                      ) -> list[str]:
    """The training settings of ``train_cfg`` that differ from ``saved_train`` (a run's or a checkpoint's
    ``asdict(TrainConfig)``), ``RESUME_SAFE`` ones aside; the schedule's length compared unless ``schedule`` is
    False or ``train_cfg`` leaves it None (the run's own)."""
    out, default = [], asdict(TrainConfig())
    for name, value in asdict(train_cfg).items():
        if name in RESUME_SAFE or (name == "schedule_steps" and (value is None or not schedule)):
            continue
        have = schedule_of({"train": saved_train}) if name == "schedule_steps" else saved_train.get(name, default[name])
        if have != value:
            out.append(f"{name}: {value!r} ({has} {have!r})")
    return out


NAMED_DATA = ("stdlib", "shakespeare")


def data_path(data: str | None) -> str:
    """What a run records as its --data: a corpus's name, or a local path made absolute (the run resumes and
    evaluates from any directory)."""
    if data in (None, *NAMED_DATA):
        return data or "stdlib"
    return str(Path(data).resolve())


def same_data(given: str, saved: str) -> bool:
    """Whether --data ``given`` names the run's ``saved`` data: the same name, or the same file or folder
    wherever it is named from. A relative path an older run recorded that does not resolve from here is taken
    as given (the corpus's sha256 the run recorded still decides)."""
    if given == saved or (given in NAMED_DATA) != (saved in NAMED_DATA):
        return given == saved
    if saved in NAMED_DATA:
        return False
    g, s = Path(given), Path(saved)
    if s.exists():
        return g.exists() and g.resolve() == s.resolve()
    return not s.is_absolute() and g.exists()


def schedule_of(saved: dict) -> int:
    """The length of a saved run's learning-rate schedule: its ``schedule_steps``, or for a run from before
    that field, the ``steps`` its last segment trained to (the schedule that segment used)."""
    return saved["train"].get("schedule_steps") or saved["train"]["steps"]


def _check_tokenizer(out: Path, saved: dict) -> Path:
    """The run's tokenizer.json, checked against the sha256 its config recorded (runs from before the
    record: that it parses). ValueError naming the file otherwise."""
    from subquad.data.dataset import file_sha256
    from subquad.data.tokenizer import load_tokenizer

    path = out / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{path} is missing: the run's token ids cannot be reproduced")
    want = saved.get("tokenizer_sha256")
    if want is not None and file_sha256(path) != want:
        raise ValueError(f"{path} is truncated or altered (its sha256 differs from the one in config.json)")
    load_tokenizer(path)
    return path


def train_run(model_cfg: ModelConfig, train_cfg: TrainConfig, out, data: str | None = None, resume: bool = False,
              vocab_size: int | None = None, progress: bool = True, log=print, token_data=None,
              device="cpu", restart: bool = False, reschedule: bool = False) -> dict:
    """Train (or with ``resume`` continue) the run in ``out`` on ``device`` (``subquad.device``: 'auto',
    'cpu', 'cuda', ...; under torchrun a plain 'cuda' is each rank's cuda:LOCAL_RANK, ``rank_device``). The
    model is built on the CPU from the seed, then moved, so every device starts from the same weights.

    A resume must name settings equal to the run's own (``read_run_config``; ``subquad train --resume``
    reads them for you): only ``RESUME_SAFE`` fields may differ, ``steps`` must pass the checkpoint's
    step, the corpus and the run's tokenizer.json must match the sha256 the run recorded, and nothing in
    the run folder is written until the checkpoint has loaded. The learning-rate schedule keeps its
    length (``schedule_steps``) unless ``reschedule``; a run that wrote checkpoints and lost them all is
    refused unless ``restart`` (which trains it again from step 0, refused while an intact checkpoint
    exists). A fresh run that fails before its first checkpoint leaves no folder behind. The folder is locked
    while it trains (``lock_run``): a second process training it is refused."""
    with ExitStack() as held:                  # the run folder's lock (lock_run), released however this ends
        return _train_run(model_cfg, train_cfg, out, data, resume, vocab_size, progress, log, token_data, device,
                          restart, reschedule, held)


def lock_run(out: Path, held: ExitStack) -> None:
    """Hold an exclusive lock on the run folder ``out`` (flock on the folder itself; the kernel releases it
    when the process ends, even when killed) until ``held`` closes: a second ``subquad train`` of the same run
    - a resume while it still trains, ranks a killed launcher left running - is refused by name instead of
    writing the same checkpoints. Rank 0 takes it (torchrun's agent stops the other ranks when it refuses). Not
    where there is no flock (Windows, filesystems without it)."""
    try:
        import fcntl
    except ImportError:
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"another process is training the run in {out} (it holds the folder's lock): wait for "
                         "it to end, or stop it, before training it again") from None
    except OSError:                            # a filesystem without flock (some Lustre, NFS, FUSE mounts)
        os.close(fd)
        return
    held.callback(os.close, fd)


def _train_run(model_cfg, train_cfg, out, data, resume, vocab_size, progress, log, token_data, device, restart,
               reschedule, held) -> dict:
    """``train_run``'s body; ``held`` keeps the run folder's lock."""
    from subquad.data.dataset import file_sha256
    from subquad.distributed.launch import use_rank_device
    from subquad.train.checkpoint import CheckpointError, find_checkpoint
    from subquad.train.trainer import _dist

    device, _ = use_rank_device(device)                        # under torchrun, 'cuda' is cuda:LOCAL_RANK
    rank, world = _dist()
    if rank != 0:
        log = lambda m: None                                   # noqa: E731  (rank 0 speaks for the run)
    out = Path(out)
    resume = resume or restart
    saved, tok_path, manifest = None, None, None
    locked = rank == 0 and out.is_dir()
    if locked:
        lock_run(out, held)
    if resume:
        saved = read_run_config(out)
        diff = resume_differences(saved, model_cfg, train_cfg, data)
        if diff:
            raise ValueError(f"--resume would change the run in {out}: " + "; ".join(diff) +
                             ". Drop those flags (the run's own settings are used) or start a new --out")
        old = schedule_of(saved)
        train_cfg = replace(train_cfg, schedule_steps=train_cfg.steps if reschedule or restart else old)
        if restart:
            try:
                found = find_checkpoint(out)
            except CheckpointError:
                found = None                                   # only broken ones: restarting is the way out
            if found is not None:
                raise ValueError(f"--restart trains a run again from step 0 only when it has no intact "
                                 f"checkpoint; {out} has {found.name} (--resume continues it)")
        elif not has_checkpoints(out) and wrote_checkpoints(out, saved):
            raise ValueError(f"the run in {out} wrote checkpoints, but ckpt/ is missing or empty; resuming would "
                             "start it from step 0 and overwrite its metrics. Pass --restart to do that")
        tok_path = _check_tokenizer(out, saved)
        manifest_path = out / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    elif out.exists() and (has_checkpoints(out) or wrote_checkpoints(out)):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    else:
        train_cfg = replace(train_cfg, schedule_steps=train_cfg.schedule_steps or train_cfg.steps)
    vocab = vocab_size or model_cfg.vocab_size
    if world > 1 and token_data is None:
        import torch.distributed as dist
        if rank == 0:                                          # rank 0 builds the token cache, then the rest read it
            token_data = prepare(data, vocab, log=log, tokenizer=tok_path, expect=manifest)
        dist.barrier()
    td = token_data or prepare(data, vocab, log=log, tokenizer=tok_path, expect=manifest)
    if token_data is not None and resume:                      # the caller's tokens: the same checks
        from subquad.data.dataset import manifest_changes

        if manifest is not None and manifest.get("sha256") != td.manifest.get("sha256"):
            raise ValueError(f"the data differ from the run's (its manifest.json): "
                             f"{'; '.join(manifest_changes(manifest, td.manifest))}")
        if saved.get("tokenizer_sha256") not in (None, file_sha256(td.tokenizer_path)):
            raise ValueError(f"the tokenizer differs from the run's tokenizer.json ({td.tokenizer_path})")
    vocab = td.tokenizer().get_vocab_size()
    if vocab != model_cfg.vocab_size:
        model_cfg = ModelConfig.from_dict({**model_cfg.to_dict(), "vocab_size": vocab})
    torch.manual_seed(train_cfg.seed)
    model = LanguageModel(model_cfg).to(device)                # bad mixer options fail here, before any write
    mesh = None
    if world > 1:
        mesh = make_mesh(replicate=train_cfg.replicate, context_parallel=train_cfg.context_parallel,
                         device_type=device.type)
    trained = parallelize(model, mesh, fsdp=train_cfg.fsdp, bf16=train_cfg.bf16,
                          activation_checkpointing=train_cfg.activation_checkpointing)
    created = not out.exists()
    trainer = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        if rank == 0 and not locked:
            try:
                lock_run(out, held)
            except ValueError:
                created = False                # another process made the folder and trains in it: not ours
                raise
        trainer = Trainer(trained, td, train_cfg, out, progress=progress and rank == 0, mesh=mesh)
        if restart:
            log(f"--restart: training {out} again from step 0 (its checkpoints are lost)")
            if rank == 0:
                shutil.rmtree(out / "ckpt", ignore_errors=True)
        elif resume:
            try:
                resumed = trainer.resume(log=log, trim_metrics=False)
            except CheckpointError as e:
                raise CheckpointError(f"{e}. --restart trains the run again from step 0") from None
            if not resumed:
                log(f"{out} has no checkpoint yet: starting it from step 0")
            elif trainer.step >= train_cfg.steps:
                raise ValueError(f"the run in {out} is at step {trainer.step} already; pass --steps above it "
                                 "to train further")
            else:
                # the schedule's length aside: a --reschedule stopped before its first checkpoint wrote it
                ckpt = trainer.resumed_train_config
                diff = [] if ckpt is None else train_differences(ckpt, train_cfg, schedule=False,
                                                                  has="the checkpoint trained with")
                if diff:                       # config.json edited by hand: the curve would not be the run's
                    raise ValueError(f"{out / 'config.json'} differs from the training its newest checkpoint (step "
                                     f"{trainer.step}) holds: {'; '.join(diff)}. Put the checkpoint's settings "
                                     "back in config.json, or train them as a new --out")
                log(f"resuming {out} from step {trainer.step}")
                _say_world(trainer.resumed_world, (ckpt or saved["train"]).get("context_parallel", 1), world,
                           train_cfg, log)
                if saved.get("packed") is not None and saved["packed"] != (trainer.eot is not None):
                    if saved["packed"]:        # another --context-parallel: the run's batches would change
                        raise ValueError(f"the run in {out} packed its batches at document starts; context "
                                         f"parallelism cannot (--context-parallel {train_cfg.context_parallel}): "
                                         "resume it with --context-parallel 1")
                    trainer.eot = None         # it read the concatenated stream (as context-parallel runs do): still
                if rank == 0:
                    trainer._trim_metrics()
                _say_schedule(train_cfg, old, trainer.step, reschedule, log)
        if rank == 0:
            if not resume:
                shutil.copyfile(td.tokenizer_path, out / "tokenizer.json")
                write_atomic(out / "manifest.json", json.dumps(td.manifest, indent=1))
            write_atomic(out / "config.json", json.dumps({
                "model": model_cfg.to_dict(), "train": asdict(train_cfg), "data": data_path(data), "world": world,
                "corpus_sha256": td.manifest.get("sha256"), "tokenizer_sha256": file_sha256(out / "tokenizer.json"),
                "checkpointed": trainer.saved_step is not None, "packed": trainer.eot is not None}, indent=1))
    except BaseException:
        if created and rank == 0:                             # nothing trained: no half-made run folder
            shutil.rmtree(out, ignore_errors=True)
        raise
    end = min(train_cfg.steps, train_cfg.schedule_steps or train_cfg.steps)   # where the rate stops changing
    if end < train_cfg.warmup:
        log(f"warning: the run's {'schedule of ' if end < train_cfg.steps else ''}{end} steps end inside the "
            f"{train_cfg.warmup}-step warmup: the learning rate reaches {train_cfg.lr_at(end):.3g}, never the peak "
            f"--lr {train_cfg.lr:g}")
    log(f"{out.name}: {model_cfg.pattern} x{model_cfg.n_layers}, {model.num_parameters():,} parameters, "
        f"{train_cfg.steps} steps of {train_cfg.batch_size} x {model_cfg.context_length} tokens"
        f"{', packed at document starts' if trainer.eot is not None else ''}")
    try:
        result = trainer.fit(log=log)
    except BaseException:
        if created and rank == 0 and trainer.saved_step is None:   # a fresh run with no checkpoint: nothing kept
            shutil.rmtree(out, ignore_errors=True)
        raise
    result["parameters"] = model.num_parameters()
    return result


def _config_or_empty(out: Path) -> dict:
    try:
        return json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return {"checkpointed": False}


def _say_world(before: int | None, before_cp: int, world: int, cfg: TrainConfig, log) -> None:
    """One line when a resume runs on another number of processes (or context-parallel groups): each group draws
    ``batch_size`` sequences (its ranks share them), so the sequences per step change with the groups."""
    if before is None or (before, before_cp) == (world, cfg.context_parallel):
        return
    was, now = before // before_cp * cfg.batch_size, world // cfg.context_parallel * cfg.batch_size
    say = lambda w, cp: f"{w} process{'es' if w > 1 else ''}" + (f", context-parallel {cp}" if cp > 1 else "")  # noqa: E731
    if was == now:
        log(f"the run trained on {say(before, before_cp)}; it continues on {say(world, cfg.context_parallel)}: the "
            f"same {now} sequences a step")
        return
    each = "context-parallel group" if cfg.context_parallel > 1 else "process"
    log(f"the run trained on {say(before, before_cp)} ({was} sequences a step); it continues on "
        f"{say(world, cfg.context_parallel)}: {now} sequences a step, each {each} drawing --batch-size "
        f"{cfg.batch_size}")


def _say_schedule(cfg: TrainConfig, old: int, step: int, reschedule: bool, log) -> None:
    """One line when a resume's --steps and the schedule's length part: what the learning rate does."""
    if reschedule and cfg.schedule_steps != old:
        before = replace(cfg, schedule_steps=old)
        log(f"--reschedule: the cosine schedule now ends at step {cfg.schedule_steps} (it ended at {old}); the "
            f"learning rate at step {step + 1} is {cfg.lr_at(step + 1):.3g} "
            f"(it was to be {before.lr_at(step + 1):.3g})")
    elif not reschedule and cfg.steps > old:
        log(f"the learning-rate schedule keeps its length, {old} steps: steps {max(old, step) + 1}-{cfg.steps} "
            f"train at its final rate {cfg.lr_at(cfg.steps):.3g} (--reschedule stretches it to {cfg.steps})")


def run_folder(path) -> Path | None:
    """The run ``path`` names - a run folder (it holds ``ckpt/``) or one of its checkpoints (``ckpt/step_N``) -
    or None for anything else (a model folder, a GGUF file): what ``--run`` takes and ``--model`` does not."""
    p = Path(path)
    if (p / "ckpt").is_dir():
        return p
    return p.parent.parent if p.parent.name == "ckpt" else None


def load_run(path, device="cpu", quantize=None, log=None, group_size=None):
    """(model in eval mode on ``device``, tokenizer, meta) from a run folder or a checkpoint folder;
    ``quantize`` "int8", "int4" or "bf16" quantises its projections for inference (``models.quant``;
    ``group_size``: int4's inputs per scale). ``log`` is
    told which step is used and why when it is not the one ``ckpt/latest`` names; the run's tokenizer.json
    is checked against the sha256 its config recorded."""
    from subquad.data.tokenizer import load_tokenizer
    from subquad.models.hf import check_group_size

    check_group_size(quantize, group_size)              # before any weight is read
    path = Path(path)
    run = run_folder(path) or path.parent.parent
    model_sd, _, meta = load_checkpoint(path, log)
    if (run / "config.json").exists():
        _check_tokenizer(run, _config_or_empty(run))
    model = LanguageModel(ModelConfig.from_dict(meta["model_config"]))
    model.load_state_dict(model_sd)
    saved = _config_or_empty(run).get("model") if (run / "config.json").exists() else None
    if saved and log is not None and config_difference(meta["model_config"], saved, skip=("vocab_size",)):
        log(f"{path}: step {meta.get('step')} holds a model of another config than {run / 'config.json'} "
            f"(its checkpoint's own config is used)")
    if quantize is not None:
        from subquad.heap import release_freed
        from subquad.models.quant import quantize as quantize_model

        quantize_model(model, quantize, group_size=group_size)
        release_freed()                   # the float matrices it replaced: their pages back (from_pretrained's)
    model.to(resolve_device(device)).eval()
    return model, load_tokenizer(run / "tokenizer.json"), meta
