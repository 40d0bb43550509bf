"""Launching processes: ``subquad train --nproc N`` re-runs itself under torchrun; ``init_from_env`` joins
its process group on the rank's own device (``rank_device``); ``run_local`` runs a function on W local
processes (gloo, file rendezvous) and returns what each returned (tests, checks)."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from subquad.device import resolve_device


def rank_device(device="cpu", env=None) -> tuple[torch.device, str]:
    """(this process's device, the process group's backend) for the requested ``device`` ('auto', 'cpu',
    'cuda', ``torch.device``) and torchrun's LOCAL_RANK in ``env`` (default ``os.environ``).

    A plain 'cuda' under torchrun is cuda:LOCAL_RANK with NCCL: one GPU per local process, where every
    rank would otherwise share cuda:0. Any other device keeps itself with gloo (NCCL takes CUDA tensors only,
    and a CPU run on a machine with GPUs must not pick it). Without LOCAL_RANK the device is as asked.
    ValueError naming --device and LOCAL_RANK when the local rank has no GPU of its own."""
    env = os.environ if env is None else env
    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev, "gloo"
    local = env.get("LOCAL_RANK")
    if local is None:
        return dev, "nccl"
    try:
        local = int(local)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer (torchrun sets it), got {local!r}") from None
    if local < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local}")
    peers = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if dev.index is not None:
        if peers > 1:             # every local rank on the one GPU named: NCCL refuses a GPU shared by ranks
            raise ValueError(f"--device {dev} puts all {peers} local processes on one GPU; pass --device cuda "
                             f"(LOCAL_RANK={local} then runs on cuda:{local}), or pick GPUs with CUDA_VISIBLE_DEVICES")
        return dev, "nccl"
    count = torch.cuda.device_count()
    if local >= count:
        raise ValueError(f"--device cuda with LOCAL_RANK={local}: this machine shows {count} GPU(s) (cuda:0.."
                         f"cuda:{count - 1}); start at most {count} processes per machine (--nproc), or check "
                         "CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", local), "nccl"


def use_rank_device(device="cpu", env=None) -> tuple[torch.device, str]:
    """``rank_device``, with its GPU made the current CUDA device: what NCCL's collectives, barriers and
    ``all_gather_object`` run on when no device is named."""
    dev, backend = rank_device(device, env)
    if dev.type == "cuda" and dev.index is not None:     # a plain 'cuda' (one process): the current one already
        torch.cuda.set_device(dev)
    return dev, backend


def init_from_env(timeout_s: float = 60.0, device="cpu"):
    """Join the process group torchrun describes (WORLD_SIZE > 1) with the backend of this rank's device
    (``use_rank_device``: cuda:LOCAL_RANK and NCCL for 'cuda', gloo for the CPU); returns (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    _, backend = use_rank_device(device)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def die_with_parent() -> None:
    """On Linux: this process gets SIGTERM when the one that started it (torchrun's agent, ``subquad train
    --nproc``) dies - even when killed outright, so that its own forwarding of signals never runs - instead of
    training on unseen in a session of its own (a second run of the folder meanwhile is refused by the folder's
    lock: ``train.run.lock_run``). Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                       # the parent died before the request: as if after it
        os.kill(os.getpid(), signal.SIGTERM)


ERRORS_ENV = "SUBQUAD_RANK_ERRORS"   # a folder where the ranks a launch started leave their one-line errors


def rank_error(message: str) -> None:
    """A rank's one-line error: into the launcher's folder (``launch`` prints each distinct one once, naming the
    ranks that had it: every rank of a run refused alike said it once each), else on stderr."""
    folder, rank = os.environ.get(ERRORS_ENV), os.environ.get("RANK")
    if folder and rank is not None and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
            f.write(message + "\n")
    else:
        print(message, file=sys.stderr)


def _said(folder: str) -> dict[str, list[int]]:
    """The ranks' errors left in ``folder``: message -> the ranks that said it."""
    said: dict[str, list[int]] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".txt") and name[4:-4].isdigit():
            with open(os.path.join(folder, name)) as f:
                for line in f.read().splitlines():
                    said.setdefault(line, []).append(int(name[4:-4]))
    return said


def launch(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None) -> int:
    """``torchrun --standalone --nproc-per-node N -m subquad <argv>``; on several machines (``nnodes`` > 1),
    torchrun's c10d rendezvous at ``rdzv_endpoint`` (HOST:PORT) in place of --standalone. Returns its exit
    code. The ranks' errors (``rank_error``) are printed once each, with the ranks that had them."""
    from torch.distributed.run import main as torchrun

    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, where the machines meet")
    where = (["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
             if nnodes > 1 or rdzv_endpoint else ["--standalone"])
    with tempfile.TemporaryDirectory() as folder:
        before = os.environ.get(ERRORS_ENV)
        os.environ[ERRORS_ENV] = folder                 # the ranks inherit it (this machine's; other nodes print)
        failed = None
        try:
            torchrun([*where, "--nproc-per-node", str(nproc), "-m", "subquad", *argv])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        except Exception as e:  # torchrun raises ChildFailedError when a rank fails
            code, failed = 1, e
        finally:
            if before is None:
                os.environ.pop(ERRORS_ENV, None)
            else:
                os.environ[ERRORS_ENV] = before
        said = _said(folder)
    for message, ranks in said.items():                  # each distinct error once, with the ranks that said it
        who = "every rank" if len(ranks) == nproc * nnodes else ", ".join(f"rank {r}" for r in ranks)
        print(f"{message} ({who})", file=sys.stderr)
    if failed is not None:
        failures = getattr(failed, "failures", None)
        if isinstance(failures, dict) and failures:     # one line, not torchrun's table
            ranks = ", ".join(f"rank {r} (exit code {getattr(f, 'exitcode', '?')})"
                              for r, f in sorted(failures.items()))
            print(f"error: the distributed run stopped: {ranks} failed"
                  + ("" if said else " (the rank's error is above)"))
        else:
            print(f"error: a rank of the distributed run failed: {failed}")
    return code


def _local_worker(rank, world, init_file, out_dir, fn, args, timeout_s):
    faulthandler.enable()           # a rank killed by a signal (SIGABRT, SIGSEGV) prints where it was
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    # gloo's full mesh can be complete on one rank while another still reads its last handshake: a rank
    # whose ``fn`` needs no collective would leave and close that pair under it ("Connection closed by
    # peer" in the other's init). Every rank passes a barrier once joined (not again before leaving: a rank
    # whose ``fn`` failed would then surface as the others' broken barrier, not as its own error).
    dist.barrier()
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter finalization, where gloo's worker threads can still be torn down and
    # abort the process ("terminate called without an active exception", SIGABRT) - a known shutdown race
    # in torch.distributed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(world: int, fn, *args, timeout_s: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` local processes (spawned: ``fn`` and ``args`` must pickle, a
    function by its module); returns their results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        mp.spawn(_local_worker, args=(world, init_file, d, fn, args, timeout_s), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
