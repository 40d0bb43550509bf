"""Ring attention on 2 and 4 processes equals single-process attention, forward and backward."""

import pytest
import torch

from subquad.distributed import ring_attention, zigzag_shard, zigzag_unshard
from subquad.ops import naive_softmax_attention
from tests.distributed.helpers import run, run_local
from tests.ops.harness import assert_close


def inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, T, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    do = torch.randn(2, T, 2, 8, generator=g, dtype=torch.float64)
    return q, k, v, do


def _ring(rank, world, T, causal, seed):
    q, k, v, do = inputs(T, seed)
    shard = [zigzag_shard(x, rank, world).requires_grad_() for x in (q, k, v)]
    o = ring_attention(*shard, causal=causal, block_size=4)
    (o * zigzag_shard(do, rank, world)).sum().backward()
    return [o.detach()] + [x.grad for x in shard]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_single_process(world, causal):
    T = 2 * world * 6                                          # chunks of c = 6 tokens
    launch = run_local if (world, causal) == (2, True) else run    # the library's launcher (spawn) once
    res = launch(world, _ring, T, causal, 1)
    q, k, v, do = (x.clone() for x in inputs(T, 1))
    for x in (q, k, v):
        x.requires_grad_()
    o, _ = naive_softmax_attention(q, k, v, causal=causal)
    (o * do).sum().backward()
    for i, ref in enumerate((o.detach(), q.grad, k.grad, v.grad)):
        got = zigzag_unshard([r[i] for r in res])
        assert_close(got, ref, 1e-10, ["o", "dq", "dk", "dv"][i])


def test_zigzag_layout_round_trips_and_refuses_bad_lengths():
    x = torch.arange(24).view(1, 24, 1, 1)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="2P = 6 equal chunks"):
        zigzag_shard(torch.zeros(1, 25, 1, 1), 0, 3)


def test_ring_attention_needs_a_process_group():
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        ring_attention(*(torch.zeros(1, 4, 1, 2) for _ in range(3)))
