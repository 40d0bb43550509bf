"""Each rank's device and backend, without a GPU: torch.cuda is stubbed to show some GPUs, and the process
group's calls are recorded instead of made.

``rank_device`` maps --device and torchrun's LOCAL_RANK to (cuda:LOCAL_RANK, nccl) or (cpu, gloo);
``init_from_env`` and ``subquad train`` use it; the trainer's all-reduces take tensors on the model's device
(the meta device stands in for a GPU: anything made on the CPU shows up as 'cpu')."""

import pytest
import torch
import torch.distributed as dist

from subquad.data import prepare
from subquad.distributed import launch
from subquad.distributed.launch import init_from_env, rank_device, use_rank_device
from subquad.models import LanguageModel, ModelConfig
from subquad.train import TrainConfig, Trainer
from subquad.train import trainer as trainer_mod


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch.cuda shows n GPUs; returns the list the stubbed set_device appends to."""
    current = []

    def show(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
        return current
    return show


def test_cpu_keeps_gloo_even_where_cuda_exists(gpus):
    gpus(2)
    for env in ({}, {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}):
        assert rank_device("cpu", env) == (torch.device("cpu"), "gloo")
        assert rank_device(torch.device("cpu"), env) == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("local", [0, 1, 3])
def test_cuda_is_the_local_ranks_gpu_with_nccl(gpus, local):
    gpus(4)
    env = {"LOCAL_RANK": str(local), "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert rank_device("cuda", env) == (torch.device("cuda", local), "nccl")
    assert rank_device(torch.device("cuda"), env) == (torch.device("cuda", local), "nccl")
    assert rank_device("auto", env) == (torch.device("cuda", local), "nccl")


def test_without_local_rank_the_device_is_as_asked(gpus):
    gpus(2)
    assert rank_device("cuda", {}) == (torch.device("cuda"), "nccl")
    assert rank_device("cuda:1", {}) == (torch.device("cuda", 1), "nccl")
    assert rank_device("cuda:1", {"LOCAL_RANK": "0", "WORLD_SIZE": "1"}) == (torch.device("cuda", 1), "nccl")


@pytest.mark.parametrize("env, words", [
    ({"LOCAL_RANK": "2", "WORLD_SIZE": "3"}, ["--device", "LOCAL_RANK=2", "2 GPU"]),
    ({"LOCAL_RANK": "x"}, ["LOCAL_RANK", "'x'"]),
    ({"LOCAL_RANK": "-1"}, ["LOCAL_RANK", ">= 0"]),
])
def test_a_local_rank_without_a_gpu_is_refused(gpus, env, words):
    gpus(2)
    with pytest.raises(ValueError) as e:
        rank_device("cuda", env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_one_named_gpu_for_several_local_ranks_is_refused(gpus):
    gpus(2)
    with pytest.raises(ValueError, match=r"--device cuda:1 puts all 2 local processes on one GPU"):
        rank_device("cuda:1", {"LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_use_rank_device_makes_the_gpu_current(gpus, monkeypatch):
    current = gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert use_rank_device("cuda") == (torch.device("cuda", 1), "nccl")
    assert current == [torch.device("cuda", 1)]
    assert use_rank_device("cpu") == (torch.device("cpu"), "gloo") and len(current) == 1


@pytest.mark.parametrize("device, backend, current", [("cpu", "gloo", []), ("cuda", "nccl", ["cuda:1"])])
def test_init_from_env_joins_with_the_devices_backend(gpus, monkeypatch, device, backend, current):
    made = gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    assert init_from_env(5.0, device=device) == (1, 2)
    assert joined == [backend] and made == [torch.device(c) for c in current]


def test_train_command_passes_its_device_to_the_process_group(monkeypatch, tmp_path):
    from subquad.cli import main
    import subquad.train

    seen = []
    monkeypatch.setattr(launch, "init_from_env", lambda timeout, device="cpu": seen.append(device) or (0, 1))

    def train_run(*args, device, **kw):
        seen.append(device)
        return {"steps": 1, "heldout_loss": None}
    monkeypatch.setattr(subquad.train, "train_run", train_run)
    assert main(["train", "--steps", "1", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert seen == [torch.device("cpu"), torch.device("cpu")]


# -- the trainer's collectives take tensors on the model's device -------------------------------------------

class _Recorded(Exception):
    pass


@pytest.fixture
def trainer(tmp_path):
    path = tmp_path / "code.py"
    path.write_text("".join(f"def f{i}(a):\n    return a - {i}\n\n" for i in range(100)))
    data = prepare(str(path), vocab_size=300, cache_dir=tmp_path / "cache", log=lambda m: None)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=300, d_model=16, n_layers=1, n_heads=2, context_length=8,
                                      pattern="linear"))
    return Trainer(model, data, TrainConfig(steps=1, batch_size=2, eval_batches=1), tmp_path / "run", progress=False)


@pytest.fixture
def reduced(monkeypatch):
    """The devices of the tensors all_reduce is given (it stops the caller after recording)."""
    devices = []

    def all_reduce(t, *a, **kw):
        devices.append(t.device)
        raise _Recorded
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return devices


def test_finiteness_flag_is_reduced_on_the_models_device(trainer, reduced):
    assert trainer._all_finite() is True                   # one process: no collective
    trainer.model.to("meta")                               # a device other than the CPU
    trainer.world = 2
    with pytest.raises(_Recorded):
        trainer._all_finite()
    assert reduced == [torch.device("meta")]


def test_context_parallel_eval_loss_is_reduced_on_the_models_device(trainer, reduced, monkeypatch):
    model = trainer.model.to("meta")
    monkeypatch.setattr(trainer_mod, "cross_entropy", lambda *a, **kw: torch.tensor(2.0))
    with pytest.raises(_Recorded):
        trainer_mod.evaluate(model, trainer.data.heldout, 8, 2, 1, cp_group=object())
    assert reduced == [torch.device("meta")]
