"""Context parallelism of a whole language model equals one process over the whole sequence."""

import pytest
import torch
import torch.distributed as dist

from subquad.distributed import context_parallel, zigzag_shard, zigzag_unshard
from subquad.models import LanguageModel, ModelConfig
from tests.distributed.helpers import run

EVERY = "softmax,swa,linear,performer,taylor,retention,gla,deltanet,gated_deltanet,mamba,mamba2"


def _model(pattern, pos_emb="none", n_kv_heads=None):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=len(pattern.split(",")), n_heads=2, n_kv_heads=n_kv_heads,
                      context_length=64, pattern=pattern, pos_emb=pos_emb,
                      mixer_options={"swa": {"window": 5}, "*": {"chunk_size": 8}})
    return LanguageModel(cfg).double()


def _data(T):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, T), generator=g), torch.randn(2, T, 64, generator=g, dtype=torch.float64)


def _cp_worker(rank, world, pattern, T, pos_emb, n_kv_heads):
    model = _model(pattern, pos_emb, n_kv_heads)
    idx, w = _data(T)
    with context_parallel() as cp:
        logits = model(zigzag_shard(idx, cp.rank, cp.world))
    (logits * zigzag_shard(w, rank, world)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)                           # the gradient of the whole sequence's loss
    return logits.detach(), grads


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern,pos_emb,n_kv_heads", [(EVERY, "none", None), ("mamba2,softmax", "learned", 1)])
def test_context_parallel_lm_equals_one_process(world, pattern, pos_emb, n_kv_heads):
    T = 2 * world * 8                                # pieces of 8 tokens: odd chunk counts, halos cross ranks
    out = run(world, _cp_worker, pattern, T, pos_emb, n_kv_heads)
    model = _model(pattern, pos_emb, n_kv_heads)
    idx, w = _data(T)
    ref = model(idx)
    (ref * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(zigzag_unshard([o[0] for o in out]), ref.detach(), rtol=0, atol=1e-10)
    for _, g in out:
        torch.testing.assert_close(g, grads, rtol=0, atol=1e-9)


def _refusals(rank, world):
    model = _model("linear,softmax")
    errors = []
    with context_parallel():
        for call in (lambda: model(torch.zeros(1, 7, dtype=torch.long)),
                     lambda: model.blocks[0].mixer(torch.zeros(1, 8, 32, dtype=torch.float64),
                                                   model.blocks[0].mixer.empty_state(1, dtype=torch.float64))):
            try:
                call()
            except ValueError as e:
                errors.append(str(e))
    return errors


def test_context_parallel_refuses_odd_shards_and_states():
    errors = run(2, _refusals)[0]
    assert len(errors) == 2
    assert "even" in errors[0]
    assert "empty state" in errors[1]


def test_context_parallel_needs_a_process_group():
    with pytest.raises(ValueError, match="torch.distributed"):
        with context_parallel():
            pass
