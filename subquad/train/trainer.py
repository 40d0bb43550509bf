"""Training: AdamW, warmup then cosine, gradient clipping, optional bfloat16 autocast, seeded,
held-out loss every N steps, metrics as JSONL, atomic checkpoints, exact resume.

The model is single-device code; parallelism is applied from outside.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from subquad.data.dataset import TokenData, get_batch, pack_batch
from subquad.device import device_of
from subquad.train.checkpoint import has_checkpoints, load_checkpoint, save_checkpoint, write_atomic


class TrainingDiverged(RuntimeError):
    pass


class PeerLost(RuntimeError):
    """A distributed run lost a rank: the others stop with this instead of hanging."""


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe")


def _is_comm_failure(e: BaseException) -> bool:
    """Only a communication failure may be reported as a lost peer; any other error is the error."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return any(w in text for w in _COMM_WORDS)


def _finite_json(rec: dict) -> str:
    """One strict-JSON line: non-finite numbers become null (JSON has no NaN or Infinity)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
    return json.dumps(clean, allow_nan=False)


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a kill while writing it) is dropped; a bad line
    anywhere else is a ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as e:
            if i == len(lines):
                break                                    # torn by a kill: the step it logged is redone
            raise ValueError(f"{path}, line {i}: not a metrics record ({e})") from None
        out.append(rec)
    return out


def _dist():
    """(rank, world) of the initialised process group, or (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


LR_MAX = 1e37     # AdamW's first step size is lr / (1 - 0.9); float32 ends at 3.4e38


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 200
    seed: int = 0
    bf16: bool = False
    context_parallel: int = 1      # ranks that share each sequence (ring attention / state passing)
    fsdp: bool = False             # shard parameters, gradients and optimizer state (FSDP2; train.parallelize)
    replicate: int = 1             # with fsdp: HSDP, this many replicas of the shards
    activation_checkpointing: bool = False   # recompute each block's activations in backward
    pack: bool | None = None       # boundaries at document starts (None: on for a corpus of many documents)
    on_nonfinite: str = "stop"     # a step with a non-finite loss or gradient: "stop" the run, or "skip" it
    schedule_steps: int | None = None   # the cosine's length (None: steps); a resume keeps it (--reschedule)

    def __post_init__(self):
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "ckpt_every", "context_parallel",
                     "replicate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"schedule_steps must be positive, got {self.schedule_steps}")
        if not 0 < self.lr <= LR_MAX:        # nan and inf fail here too
            raise ValueError(f"lr must be a finite number in (0, {LR_MAX:g}], got {self.lr} (AdamW's first step "
                             "size is lr / (1 - 0.9) = 10 x lr, which must fit in float32)")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.replicate > 1 and not self.fsdp:
            raise ValueError(f"replicate={self.replicate} (HSDP) needs fsdp=True")

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr, then cosine down to min_lr_ratio * lr at the schedule's last step
        (``schedule_steps``, else ``steps``), and after it the rate that step had (steps count from 1): the
        floor, or for a schedule that ends inside the warmup, the warmup's rate at its end."""
        step = min(step, self.schedule_steps or self.steps)
        if step <= self.warmup:
            return self.lr * step / max(1, self.warmup)
        frac = (step - self.warmup) / max(1, (self.schedule_steps or self.steps) - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def cross_entropy(model, x, y, bf16=False, cp_group=None, eot=None):
    """Mean next-token loss, on the model's device (x and y are moved there; ``bf16``: autocast there). With ``cp_group`` (context parallel), this rank's zigzag shard of x and y only:
    every rank holds as many tokens, so the mean over ranks is the loss of the whole sequences.
    With ``eot`` (packing), the rows are packed with boundaries at document starts (``pack_batch``): no
    token sees another document, and no target crosses into the next one."""
    dev = device_of(model)
    cu = None
    if eot is not None:
        x, y, cu = pack_batch(x, y, eot)
    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)     # batches follow the model
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16), _context(cp_group) as cp:
        if cp is not None:
            from subquad.distributed import zigzag_shard

            x, y = zigzag_shard(x, cp.rank, cp.world), zigzag_shard(y, cp.rank, cp.world)
        # the model's own loss: the head and the cross-entropy in chunks, the logits never held whole
        return model(x, targets=y) if cu is None else model(x, cu_seqlens=cu.to(dev), targets=y)


def _context(cp_group):
    import contextlib

    if cp_group is None:
        return contextlib.nullcontext()
    from subquad.distributed import context_parallel

    return context_parallel(cp_group)


@torch.no_grad()
def evaluate(model, tokens, context: int, batch_size: int, batches: int, bf16=False, seed: int = 1234,
             cp_group=None, eot=None) -> float:
    """Mean held-out loss (nats/token) over the same fixed windows every call (with ``cp_group``: a collective
    of the group, each rank its shard, the mean over the group)."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses = [cross_entropy(model, *get_batch(tokens, batch_size, context, g), bf16=bf16, cp_group=cp_group,
                            eot=eot).item() for _ in range(batches)]
    model.train(was)
    loss = sum(losses) / len(losses)
    if cp_group is not None:
        import torch.distributed as dist

        t = torch.tensor(loss, dtype=torch.float64, device=device_of(model))    # the group's device (NCCL: CUDA)
        dist.all_reduce(t, group=cp_group)
        loss = float(t) / dist.get_world_size(cp_group)
    return loss


def decay_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: ``weight_decay`` on matrices and embeddings (dim >= 2), none on norms, biases,
    per-head vectors and the parameters a layer marks ``_no_weight_decay`` as Mamba's authors do (A_log and D:
    Mamba-1's A_log is a (d_inner, N) matrix, spared all the same)."""
    params = list(model.parameters())
    spared = [p.dim() < 2 or getattr(p, "_no_weight_decay", False) for p in params]
    return [{"params": [p for p, s in zip(params, spared) if not s], "weight_decay": weight_decay},
            {"params": [p for p, s in zip(params, spared) if s], "weight_decay": 0.0}]


def packing_eot(pack, data, context_parallel: int = 1):
    """The end-of-text id to pack batches at (``TrainConfig.pack``: True, False, or None - on for a corpus
    of many documents), or None for the concatenated stream."""
    if pack is False:
        return None
    if context_parallel > 1:
        if pack:
            raise ValueError("pack=True needs one process per sequence: context parallelism splits a sequence "
                             "across ranks and cannot take document boundaries (use --no-pack)")
        return None
    eot = getattr(data, "eot", None)
    if eot is None or (pack is None and data.documents() < 2):
        if pack:
            raise ValueError("pack=True needs a corpus of documents separated by end-of-text tokens")
        return None
    return eot


class Trainer:
    """Trains ``model`` as ``train.parallelize`` left it: on more than one process, pass the ``mesh`` it was
    parallelised over (``model`` may then be a DDP wrapper, or sharded in place by FSDP2). The loop has no
    gradient code of its own: DDP or FSDP averages the gradients over the mesh."""

    def __init__(self, model, data: TokenData, cfg: TrainConfig, run_dir, progress: bool = True, extra_meta=None,
                 mesh=None):
        from subquad.train.parallelize import Layout, is_sharded, unwrap

        self.train_model, self.model = model, unwrap(model)
        self.data, self.cfg = data, cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.context = self.model.config.context_length
        self.extra_meta = extra_meta or {}
        torch.manual_seed(cfg.seed)
        self.rank, self.world = _dist()
        if self.world > 1 and mesh is None:
            raise ValueError(f"a Trainer on {self.world} processes needs the mesh its model was parallelised over: "
                             "mesh = make_mesh(...); model = parallelize(model, mesh, ...) (subquad.train.parallelize)")
        layout = Layout.of(mesh)
        self.cp_group = layout.cp_group
        P = 1 if self.cp_group is None else self.cp_group.size()
        if P != cfg.context_parallel:
            raise ValueError(f"context_parallel={cfg.context_parallel}, but the mesh's cp dimension has {P} ranks")
        if P > 1 and self.context % (2 * P):               # one process: any length
            raise ValueError(f"context_length={self.context} must divide into 2 x context_parallel = {2 * P} "
                             "equal pieces (the zigzag layout)")
        self.sharded = is_sharded(self.model)
        # each data-parallel replica draws its own batches (the ranks sharing a sequence draw the same);
        # replica 0's stream is the single-process one
        self.gen = torch.Generator().manual_seed(cfg.seed + 1_000_003 * layout.replica)
        self.replica, self.replicas = layout.replica, layout.replicas
        self.opt = torch.optim.AdamW(decay_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
        self.step = 0
        self.curve: list[tuple[int, float]] = []
        self.saved_step: int | None = None    # the newest checkpoint this trainer wrote or resumed from
        self.resumed_train_config: dict | None = None   # the training a resumed checkpoint holds (_resume_meta)
        self.resumed_world: int | None = None            # and the processes that wrote it
        self.last_record: dict | None = None  # metrics.jsonl's record of self.step, kept in the checkpoint
        self.eot = packing_eot(cfg.pack, data, cfg.context_parallel)

    def _all_finite(self) -> bool:
        """Whether every weight is finite, on every rank (each checks the shards it holds)."""
        from torch.distributed.tensor import DTensor

        # the flag stays on the model's device, where the process group's backend works (NCCL takes no
        # CPU tensor), and is read back once
        checks = [torch.ones((), dtype=torch.bool, device=device_of(self.model))]
        checks += [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in self.model.parameters()]
        flag = torch.stack(checks).all().float()
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    # -- state ---------------------------------------------------------------------------------------------
    def _meta(self):
        states = [(self.replica, self.gen.get_state().tolist())]
        if self.world > 1:
            import torch.distributed as dist
            states = [None] * self.world
            dist.all_gather_object(states, (self.replica, self.gen.get_state().tolist()))
        replicas = dict(states)                        # a data stream's state: every rank of its group holds it
        replicas = [replicas[r] for r in range(len(replicas))]
        states = [s for _, s in states]
        # strict JSON: a non-finite held-out loss (on_nonfinite="skip") is kept as null
        curve = [(s, v if math.isfinite(v) else None) for s, v in self.curve]
        return {"model_config": self.model.config.to_dict(), "train_config": asdict(self.cfg),
                "data_rng": states[0], "data_rng_ranks": states, "data_rng_replicas": replicas, "world": self.world,
                "curve": curve,
                "metrics": self.last_record if self.last_record and self.last_record["step"] == self.step else None,
                **self.extra_meta}

    def _kept(self) -> str:
        """Where the last good checkpoint is, for the stop messages."""
        if self.saved_step is None:
            return "There is no checkpoint yet"
        return f"The last good checkpoint, step {self.saved_step}, is kept in {self.run_dir / 'ckpt'}"

    def save(self):
        if not self._all_finite():
            raise TrainingDiverged(f"the model's weights are not finite at step {self.step}; not saved. "
                                   f"{self._kept()}")
        meta = self._meta()                      # a collective when distributed: every rank calls it
        if self.sharded:                         # every rank writes its shards (train.sharded)
            from subquad.train.sharded import save_sharded

            path = save_sharded(self.run_dir, self.step, self.model, self.opt, meta)
            self.saved_step = self.step
            return path
        path = save_checkpoint(self.run_dir, self.step, self.model, self.opt, meta) if self.rank == 0 else None
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()
        self.saved_step = self.step
        return path

    def resume(self, log=None, trim_metrics: bool = True) -> bool:
        """Continue from the run's newest intact checkpoint (False when it has none yet). metrics.jsonl is
        cut back to the steps the checkpoint covers (``trim_metrics=False``: the caller does it later)."""
        if not has_checkpoints(self.run_dir):
            return False
        if self.sharded:
            self._resume_sharded(log, trim_metrics)
            return True
        model_sd, optim_sd, meta = load_checkpoint(self.run_dir, log)      # the newest intact one, verified once
        try:
            self.model.load_state_dict(model_sd)
        except RuntimeError as e:                  # another model's checkpoint in this run's folder: named
            diff = config_difference(meta.get("model_config") or {}, self.model.config.to_dict())
            raise ValueError(f"{self.run_dir}: its newest checkpoint (step {meta.get('step')}) holds another "
                             f"model than this run's config: {'; '.join(diff[:6]) or 'its tensors shapes differ'}"
                             ) from e
        self.opt.load_state_dict(optim_sd)
        self._resume_meta(meta, trim_metrics)
        return True

    def _resume_sharded(self, log, trim_metrics: bool = True):
        """A sharded model resumes from shards (any number of processes wrote them) or from a full checkpoint,
        each rank loading only its own shard of every tensor."""
        import json

        from subquad.train.checkpoint import find_checkpoint
        from subquad.train.sharded import FORMAT, load_full_into, load_sharded

        found = find_checkpoint(self.run_dir, log if self.rank == 0 else None)
        meta = json.loads((found / "meta.json").read_text())
        if meta.get("format") == FORMAT:
            load_sharded(found, self.model, self.opt)
        else:
            model_sd, optim_sd, meta = load_checkpoint(found)
            load_full_into(self.model, self.opt, model_sd, optim_sd)
        self._resume_meta(meta, trim_metrics)

    def _resume_meta(self, meta: dict, trim_metrics: bool):
        # each data stream continues from its own state, whichever ranks draw it now (the ranks of a context-parallel
        # group share one); a stream the run did not have starts fresh. Checkpoints from before kept one state a
        # rank: rank i drew stream i // P (the mesh's cp dimension innermost)
        replicas = meta.get("data_rng_replicas")
        if replicas is None:
            ranks = meta.get("data_rng_ranks") or [meta["data_rng"]]
            P = (meta.get("train_config") or {}).get("context_parallel", 1)
            replicas = ranks[::P]
        if self.replica < len(replicas):
            self.gen.set_state(torch.tensor(replicas[self.replica], dtype=torch.uint8))
        self.step = self.saved_step = meta["step"]
        self.resumed_train_config, self.resumed_world = meta.get("train_config"), meta.get("world")
        self.curve = [(s, float("nan") if v is None else v) for s, v in meta.get("curve", [])]
        self.last_record = meta.get("metrics")
        if self.rank == 0 and trim_metrics:
            self._trim_metrics()

    def _trim_metrics(self):
        """metrics.jsonl becomes exactly one record per step the checkpoint covers (steps after it are redone
        and logged again), rewritten atomically. The checkpointed step's own record, when its line was torn,
        comes back from the checkpoint's meta."""
        path = self.run_dir / "metrics.jsonl"
        by_step = {}
        for rec in read_metrics(path):
            if rec["step"] <= self.step:
                by_step[rec["step"]] = rec                 # a step logged twice (a restart): the latest
        if self.step not in by_step and self.last_record and self.last_record.get("step") == self.step:
            by_step[self.step] = self.last_record
        write_atomic(path, "".join(_finite_json(by_step[k]) + "\n" for k in sorted(by_step)))

    # -- loop ----------------------------------------------------------------------------------------------
    def fit(self, log=print, stop_at: int | None = None) -> dict:
        """Train to ``cfg.steps`` (or stop early after step ``stop_at``, as a kill would, for staged runs)."""
        cfg, model = self.cfg, self.model
        last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model.train()
        bar = None
        lead = self.rank == 0                    # rank 0 logs, evaluates and writes checkpoints
        if self.progress and lead:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, desc=self.run_dir.name, unit="step", leave=False,
                       dynamic_ncols=True)
        if lead and self.step == 0:                # a fresh start: no lines from a run killed before its checkpoint
            write_atomic(self.run_dir / "metrics.jsonl", "")
        tok = getattr(self.data, "tokenizer_path", None)
        if lead and tok is not None and not (self.run_dir / "tokenizer.json").exists():
            shutil.copyfile(tok, self.run_dir / "tokenizer.json")
        metrics = open(self.run_dir / "metrics.jsonl", "a") if lead else None
        n_skipped = 0                            # steps on_nonfinite="skip" dropped in this call
        tokens_per_step = cfg.batch_size * self.context
        t_last, tok_rate = time.perf_counter(), 0.0
        try:
            while self.step < last:
                step = self.step + 1
                lr = cfg.lr_at(step)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                x, y = get_batch(self.data.train, cfg.batch_size, self.context, self.gen)
                try:
                    loss = cross_entropy(self.train_model, x, y, cfg.bf16, self.cp_group, self.eot)
                    if not torch.isfinite(loss) and cfg.on_nonfinite == "stop":
                        raise TrainingDiverged(f"loss became {loss.item()} at step {step}; stopped. {self._kept()} "
                                               "(try a lower --lr)")
                    self.opt.zero_grad(set_to_none=True)
                    moe = getattr(model.config, "moe", None)
                    if moe:                      # the router's load-balancing loss joins the objective
                        aux = model.aux_loss()
                        (loss + moe["aux_loss_coef"] * aux).backward()
                        aux = aux.detach()
                    else:
                        loss.backward()          # DDP all-reduces the gradients here
                    if self.world > 1:
                        import torch.distributed as dist
                        logged = loss.detach().clone()
                        dist.all_reduce(logged)
                        loss = logged / self.world
                except RuntimeError as e:
                    if self.world > 1 and not isinstance(e, TrainingDiverged) and _is_comm_failure(e):
                        raise PeerLost(f"rank {self.rank}: a peer stopped answering at step {step} ({e}); "
                                       "stopping instead of waiting") from None
                    raise
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm    # FSDP: a DTensor
                skipped = not (torch.isfinite(loss) and torch.isfinite(gnorm))
                if skipped and cfg.on_nonfinite == "stop":   # no update and no checkpoint from this step
                    raise TrainingDiverged(f"the gradient norm became {float(gnorm)} at step {step}; stopped before "
                                           f"updating. {self._kept()} (try a lower --lr, or --on-nonfinite skip: "
                                           "on_nonfinite='skip')")
                if skipped:
                    self.opt.zero_grad(set_to_none=True)     # on_nonfinite="skip": the batch is consumed, no update
                    n_skipped += 1
                else:
                    self.opt.step()
                self.step = step
                now = time.perf_counter()
                tok_rate = tokens_per_step / max(now - t_last, 1e-9)
                t_last = now
                rec = {"step": step, "loss": round(loss.item(), 5), "lr": lr, "grad_norm": round(float(gnorm), 4),
                       "tokens_per_s": round(tok_rate, 1), "tokens": tokens_per_step * self.replicas,
                       **({"skipped": True} if skipped else {})}
                if moe:
                    rec["aux_loss"] = round(aux.item(), 5)
                if step % cfg.eval_every == 0 or step == cfg.steps:    # every rank: FSDP's forward is a collective
                    ev = evaluate(model, self.data.heldout, self.context, cfg.batch_size, cfg.eval_batches, cfg.bf16,
                                  cp_group=self.cp_group, eot=self.eot)
                    rec["heldout_loss"] = round(ev, 5)
                    self.curve.append((step, ev))
                    t_last = time.perf_counter()       # evaluation time is not training throughput
                line = _finite_json(rec)
                self.last_record = json.loads(line)      # as logged; a checkpoint of this step keeps it
                if metrics is not None:
                    metrics.write(line + "\n")
                    metrics.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tok_rate:,.0f}",
                                    **({"heldout": f"{rec['heldout_loss']:.3f}"} if "heldout_loss" in rec else {}))
                if step % cfg.ckpt_every == 0 or step == cfg.steps:
                    self.save()
        finally:
            if metrics is not None:
                metrics.close()
            if bar is not None:
                bar.close()
        return {"steps": self.step, "heldout_loss": self.curve[-1][1] if self.curve else None, "curve": self.curve,
                "skipped_steps": n_skipped}


def config_difference(saved: dict, mine: dict, skip=()) -> list[str]:
    """'field saved (the run's mine)' for each model-config field both dicts name and hold differently (but
    ``skip``): a checkpoint's ``model_config`` against the run's."""
    return [f"{k} {saved[k]!r} (the run's {mine[k]!r})" for k in sorted(saved.keys() & mine.keys())
            if k not in skip and saved[k] != mine[k]]
