"""Context parallelism of a whole language model equals one process over the whole sequence."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from subquad.distributed import context_parallel, zigzag_shard, zigzag_unshard
from subquad.layers import ShortConv
from subquad.layers.base import Mixer
from subquad.layers.rotary import apply_rotary
from subquad.models import LanguageModel, ModelConfig
from subquad.ops import simple_gla
from tests.distributed.helpers import run

EVERY = "softmax,swa,linear,performer,taylor,retention,gla,deltanet,gated_deltanet,mamba,mamba2,kda,mla,lightning"


# the checkpoint types' options: Bamba (Mamba-2 with 2 groups, partial rotary) and Jamba (weighted dt/B/C
# norms, attention without positions, a mixture of experts)
CHECKPOINT_OPTIONS = {
    "bamba": ({"mamba2": {"n_groups": 2, "head_dim": 8, "norm_eps": 1e-5},
               "softmax": {"rotary_fraction": 0.5, "rotary_base": 500.0}}, None),
    "jamba": ({"mamba": {"bcdt_rms_eps": 1e-6, "bcdt_rms_weight": True}, "softmax": {"rotary": False}},
              {"experts": 3, "top_k": 2, "every": 2, "offset": 1}),
    "recurrent_gemma": ({"rglru": {}, "swa": {"window": 5, "o_bias": True, "rotary_fraction": 0.5}}, None),
    # not a checkpoint type: the short-convolution option of linear attention, RetNet and GLA (its halo crosses ranks)
    "conv": ({n: {"conv_size": 4} for n in ("linear", "retention", "gla")}, None),
    # RWKV-7's blocks: the channel mix's token shift crosses ranks too, and the value residual crosses layers
    "rwkv7": ({}, None, {"mlp": True, "mlp_kind": "rwkv7", "norm": "layer", "embed_norm": True}),
    # Zamba2's shared blocks: attention with adapters and rotary over [h, embeddings] at two layers, one block
    "zamba2": ({"mamba2": {"n_groups": 2, "head_dim": 8, "norm_eps": 1e-5}}, None,
               {"shared": {"layers": [1, 2], "adapter_rank": 2, "attention_adapter": True, "rotary": True,
                           "scale": 0.3}}),
}


def _model(pattern, pos_emb="none", n_kv_heads=None, kind=None):
    torch.manual_seed(0)
    opts, moe, *fields = CHECKPOINT_OPTIONS[kind] if kind else ({}, None)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=len(pattern.split(",")), n_heads=2, n_kv_heads=n_kv_heads,
                      context_length=64, pattern=pattern, pos_emb=pos_emb, moe=moe,
                      mixer_options={"swa": {"window": 5}, "*": {"chunk_size": 8}, **opts},
                      **{"mlp": moe is not None, **(fields[0] if fields else {})})
    return LanguageModel(cfg).double()


def _data(T):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, T), generator=g), torch.randn(2, T, 64, generator=g, dtype=torch.float64)


def _cp_worker(rank, world, pattern, T, pos_emb, n_kv_heads, kind=None):
    model = _model(pattern, pos_emb, n_kv_heads, kind)
    idx, w = _data(T)
    with context_parallel() as cp:
        logits = model(zigzag_shard(idx, cp.rank, cp.world))
    (logits * zigzag_shard(w, rank, world)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])   # None: unused
    dist.all_reduce(grads)                           # the gradient of the whole sequence's loss
    return logits.detach(), grads


def _assert_cp_equals_one_process(world, pattern, T, pos_emb, n_kv_heads, kind=None):
    """Logits and the gradient of a weighted sum on ``world`` ranks equal one process over the sequence."""
    out = run(world, _cp_worker, pattern, T, pos_emb, n_kv_heads, kind)
    model = _model(pattern, pos_emb, n_kv_heads, kind)
    idx, w = _data(T)
    ref = model(idx)
    (ref * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])   # None: unused
    torch.testing.assert_close(zigzag_unshard([o[0] for o in out]), ref.detach(), rtol=0, atol=1e-10)
    for _, g in out:
        torch.testing.assert_close(g, grads, rtol=0, atol=1e-9)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern,pos_emb,n_kv_heads", [(EVERY, "none", None), ("mamba2,softmax", "learned", 1)])
def test_context_parallel_lm_equals_one_process(world, pattern, pos_emb, n_kv_heads):
    T = 2 * world * 8                                # pieces of 8 tokens: odd chunk counts, halos cross ranks
    _assert_cp_equals_one_process(world, pattern, T, pos_emb, n_kv_heads)


@pytest.mark.parametrize("kind,pattern", [("bamba", "mamba2,softmax"), ("jamba", "mamba,softmax"),
                                          ("conv", "linear,retention,gla"), ("recurrent_gemma", "rglru,swa,rglru"),
                                          ("rwkv7", "rwkv7,rwkv7,softmax"), ("zamba2", "mamba2,mamba2,mamba2")])
def test_context_parallel_checkpoint_structures_equal_one_process(kind, pattern):
    T = 2 * 2 * 8
    _assert_cp_equals_one_process(2, pattern, T, "none", 1, kind)


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


class NewMixer(Mixer):
    """A mixer the distributed package has never seen: a short convolution, rotary positions and a decayed
    recurrence, written against the sequence backend only."""

    def __init__(self, d_model=16, n_heads=2):
        super().__init__(d_model, "chunk", 4)
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.conv = ShortConv(3 * d_model, 3)
        self.g = nn.Linear(d_model, n_heads)

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        qkv, conv = self.short_conv(self.qkv(x), state, seq)
        q, k, v = qkv.view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        pos = seq.positions(T, 0, x.device)
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
        o, S = seq.recurrence(simple_gla, q, k, v, -F.softplus(self.g(x)), mode=self.mode,
                              chunk_size=self.chunk_size, initial_state=None if state is None else state["S"])
        return o.reshape(B, T, -1), {"S": S, "conv": conv}


def _new_mixer(rank, world, x, w):
    torch.manual_seed(0)
    m = NewMixer().double()
    with context_parallel() as cp:
        y, state = m(zigzag_shard(x, cp.rank, cp.world))
    (y * zigzag_shard(w, rank, world)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters()])
    dist.all_reduce(grads)
    return y.detach(), grads, state


def test_a_new_mixer_is_context_parallel_without_distributed_code():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, 16, generator=g, dtype=torch.float64)
    w = torch.randn(2, 24, 16, generator=g, dtype=torch.float64)
    out = run(2, _new_mixer, x, w)
    torch.manual_seed(0)
    m = NewMixer().double()
    ref, _ = m(x)
    (ref * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters()])
    torch.testing.assert_close(zigzag_unshard([o[0] for o in out]), ref.detach(), rtol=0, atol=1e-10)
    for _, gr, state in out:
        torch.testing.assert_close(gr, grads, rtol=0, atol=1e-9)
        assert state is None                        # a shard of a sequence gives no decoding state
