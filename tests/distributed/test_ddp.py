"""Data-parallel training: 2 processes equal one process on the concatenated batch; a lost rank stops the rest."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from subquad.data import get_batch, prepare
from subquad.models import LanguageModel, ModelConfig
from subquad.train import PeerLost, TrainConfig, Trainer, load_checkpoint, make_mesh, parallelize
from subquad.train import trainer as trainer_mod
from tests.distributed.helpers import run
from tests.forked import context

TEXT = "".join(f"def k{i}(a):\n    return a + {i}\n\n" for i in range(300))
CFG = dict(steps=3, batch_size=2, lr=3e-3, warmup=1, eval_every=3, eval_batches=1, ckpt_every=3, seed=0)


def model():
    """Three mixers; RWKV-7's first layer leaves its ``v_lora`` without a gradient (the checkpoint formats hold
    it), which DDP must be told of or it stops at the second step."""
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=300, d_model=32, n_layers=3, n_heads=2, context_length=16,
                                     pattern="linear,rwkv7,softmax"))


def _train(rank, world, corpus, cache, out):
    data = prepare(corpus, vocab_size=300, cache_dir=cache, log=lambda m: None)
    mesh = make_mesh()
    Trainer(parallelize(model(), mesh, fsdp=False), data, TrainConfig(**CFG), out, progress=False, mesh=mesh).fit()
    return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    (d / "code.py").write_text(TEXT)
    prepare(str(d / "code.py"), vocab_size=300, cache_dir=d / "cache", log=lambda m: None)
    return d


def test_two_process_ddp_equals_one_process_on_the_concatenated_batch(corpus, tmp_path, monkeypatch):
    run(2, _train, str(corpus / "code.py"), str(corpus / "cache"), str(tmp_path / "ddp"))
    data = prepare(str(corpus / "code.py"), vocab_size=300, cache_dir=corpus / "cache", log=lambda m: None)
    gens = [torch.Generator().manual_seed(CFG["seed"] + 1_000_003 * r) for r in range(2)]

    def both_ranks(tokens, batch_size, context, generator):
        parts = [get_batch(tokens, batch_size // 2, context, g) for g in gens]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    monkeypatch.setattr(trainer_mod, "get_batch", both_ranks)
    Trainer(model(), data, TrainConfig(**{**CFG, "batch_size": 4}), tmp_path / "one", progress=False).fit()
    import json
    loss = [[json.loads(ln)["loss"] for ln in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("ddp", "one")]
    assert loss[0] == pytest.approx(loss[1], abs=1e-4)
    a, _, meta = load_checkpoint(tmp_path / "ddp")
    b, _, _ = load_checkpoint(tmp_path / "one")
    assert meta["world"] == 2 and len(meta["data_rng_ranks"]) == 2
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def _lose_a_rank(rank, world, init_file, corpus, cache, out, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    data = prepare(corpus, vocab_size=300, cache_dir=cache, log=lambda m: None)
    mesh = make_mesh()
    t = Trainer(parallelize(model(), mesh, fsdp=False), data, TrainConfig(**{**CFG, "steps": 50}), out,
                progress=False, mesh=mesh)
    if rank == 1:
        os._exit(3)                                    # a rank dies mid-run
    try:
        t.fit()
        msg = "finished"
    except PeerLost as e:
        msg = f"PeerLost: {e}"
    except Exception as e:                            # anything else is a failure of the test
        msg = f"{type(e).__name__}: {e}"
    with open(result_file, "w") as f:
        f.write(msg)


def test_a_rank_that_dies_stops_the_others_with_a_clear_error(corpus, tmp_path):
    ctx = context()                                    # forked from the tests' forkserver (tests/forked.py)
    init_file, result = str(tmp_path / "rdv"), str(tmp_path / "rank0.txt")
    procs = [ctx.Process(target=_lose_a_rank, args=(r, 2, init_file, str(corpus / "code.py"), str(corpus / "cache"),
                                                     str(tmp_path / "run"), result)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=90)
    alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, "rank 0 hung after its peer died"
    text = open(result).read()
    assert text.startswith("PeerLost") and "peer stopped answering" in text, text


def _train_cp(rank, world, corpus, cache, out, P, pattern):
    data = prepare(corpus, vocab_size=300, cache_dir=cache, log=lambda m: None)
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, context_length=16,
                                  pattern=pattern))
    mesh = make_mesh(context_parallel=P)
    Trainer(parallelize(m, mesh, fsdp=False), data, TrainConfig(**{**CFG, "context_parallel": P}), out,
            progress=False, mesh=mesh).fit()
    return None


@pytest.mark.parametrize("world,P,pattern", [(2, 2, "mamba2,softmax"), (4, 2, "linear,softmax")])
def test_context_parallel_training_equals_one_process(corpus, tmp_path, monkeypatch, world, P, pattern):
    """P ranks share each sequence (world / P replicas): losses and weights match one process."""
    run(world, _train_cp, str(corpus / "code.py"), str(corpus / "cache"), str(tmp_path / "cp"), P, pattern)
    data = prepare(str(corpus / "code.py"), vocab_size=300, cache_dir=corpus / "cache", log=lambda m: None)
    replicas = world // P
    gens = [torch.Generator().manual_seed(CFG["seed"] + 1_000_003 * r) for r in range(replicas)]

    def every_replica(tokens, batch_size, context, generator):
        if generator is not gens[0]:                            # held-out evaluation: the same windows
            return get_batch(tokens, batch_size, context, generator)
        parts = [get_batch(tokens, batch_size // replicas, context, g) for g in gens]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    torch.manual_seed(0)
    one = LanguageModel(ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, context_length=16,
                                    pattern=pattern))
    trainer = Trainer(one, data, TrainConfig(**{**CFG, "batch_size": CFG["batch_size"] * replicas}),
                      tmp_path / "one", progress=False)
    gens[0] = trainer.gen
    monkeypatch.setattr(trainer_mod, "get_batch", every_replica)
    trainer.fit()
    import json
    runs = [[json.loads(ln) for ln in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("cp", "one")]
    assert [r["loss"] for r in runs[0]] == pytest.approx([r["loss"] for r in runs[1]], abs=1e-4)
    if replicas == 1:                                           # (more replicas: a larger evaluation batch)
        assert runs[0][-1]["heldout_loss"] == pytest.approx(runs[1][-1]["heldout_loss"], abs=1e-4)
    a, _, meta = load_checkpoint(tmp_path / "cp")
    b, _, _ = load_checkpoint(tmp_path / "one")
    assert meta["train_config"]["context_parallel"] == P
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def _bad_cp(rank, world, corpus, cache, out):
    data = prepare(corpus, vocab_size=300, cache_dir=cache, log=lambda m: None)
    try:
        make_mesh(context_parallel=3)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_context_parallel_must_divide_the_processes(corpus, tmp_path):
    msgs = run(2, _bad_cp, str(corpus / "code.py"), str(corpus / "cache"), str(tmp_path / "bad"))
    assert all("context_parallel=3 must divide the number of processes (2)" in m for m in msgs), msgs
