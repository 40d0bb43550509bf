"""A decoding token's run of Mamba-2 and softmax attention blocks in one C call (``kernels/layer_stack.c``).

``models.stack`` runs consecutive Mamba-2 blocks in one call each run; a hybrid's attention layers between them
(Bamba's every sixth, Granite 4's, Nemotron-H's) still cost two C calls, the cache's append and ~150 us of Python
each on cold caches, and split the Mamba-2 layers into several runs: ~1 ms of an 8-bit hybrid token's 11
(benchmarks/RESULTS.md, "One call for a hybrid's layers"). ``MixedStep`` takes the whole run - Mamba-2 blocks'
and attention blocks' kept steps (``ops.decay.fused_block.BlockStep``, ``layers.attention_step.Step``), each with
its MLP's (``ops.mlp_block.MlpStep``) or none - as one table and one call; per attention layer Python only opens
the cache's next column (``KVCache.opened``: a fork, the caller's cache unchanged) and the kernel writes the key
and value there. Each layer runs the C functions its own kept calls run, so the result equals the blocks one by
one, bit for bit (tests/models/test_layer_stack.py).

``step(h (B, 1, d), states)`` with per layer (conv state, ssm state) for a Mamba-2 block, the ``KVCache`` for an
attention block -> (h' (B, 1, d), the new state dict per layer: {"ssm", "conv"} or {"kv"}).
"""

from __future__ import annotations

import array
import struct

import torch

from subquad.kernels import I64, INT, PTR, Kernel
from subquad.layers import attention_step
from subquad.ops import mlp_block
from subquad.ops.decay import fused_block as mamba2_block
from subquad.ops.mamba.fused_block import _words

KERNEL = Kernel("layer_stack", [I64, I64, I64, PTR, INT, PTR, PTR, PTR], "layer_stack")
MLP_WORDS = 1 + mlp_block.ARGS                     # 1 and the MLP's arguments, or 0 and zeros
# attn_in_rows', attn_out_rows' arguments (attention_step.c: 37, 23), then the rows' position
ATTN_IN, ATTN_OUT = len(attention_step.IN.argtypes), len(attention_step.OUT.argtypes)
ATTN_WORDS = ATTN_IN + ATTN_OUT + 1
ROW = 1 + ATTN_WORDS + MLP_WORDS                   # the kind, the layer's words (a Mamba-2 row is shorter)
MAMBA2, ATTENTION = 0, 1


def _bits64(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _attention_words(step) -> list:
    """An attention ``Step``'s two calls' arguments as words: the eps floats and the scale as float bits, the
    rotary base as double bits, the per-call slots 0 (filled per call or unused)."""
    words = _words(step.call_in.raw, attention_step.IN_FLOATS) + _words(step.call_out.raw, attention_step.OUT_FLOATS)
    words[attention_step.IN_DOUBLE] = _bits64(float(step.call_in.raw[attention_step.IN_DOUBLE]))
    return words + [0]


def _attention_fill(step, at: int) -> tuple:
    """The row's words (from ``at``) a call fills, found from the step's own calls' slots (attn_in's: threads, h,
    pos, ...; attn_out's: L, threads, q, kc, kb, vc, vb, start, ...): pos; L, kc, kb, vc, vb, start; then the
    position used where pos is NULL."""
    pos, out = step.call_in.slots[2], [ATTN_IN + j for j in step.call_out.slots]
    return (at + pos, at + out[0], *(at + j for j in out[3:8]), at + ATTN_IN + ATTN_OUT)


def _mlp_words(mlp) -> list:
    return [0] * MLP_WORDS if mlp is None else [1] + _words(mlp.call.raw, mlp_block.FLOATS)


class MixedStep:
    """``steps`` (consecutive blocks' kept steps at the same rows: Mamba-2 ``BlockStep``s and attention ``Step``s)
    with their MLPs' steps (``mlps``, None where a block has none) in one call (the module doc)."""

    def __init__(self, steps: list, mlps: list):
        self.kernel, self.steps = KERNEL, tuple(steps)
        self.B, self.d = steps[0].B, steps[0].d
        self.kinds, rows, self.fill = [], [], []
        for i, (step, mlp) in enumerate(zip(steps, mlps)):
            at = ROW * i + 1
            if isinstance(step, mamba2_block.BlockStep):
                words = _words(step.call.raw, mamba2_block.STACK_FLOATS)
                slots = step.call.slots     # threads, h, conv state, state, h', new conv state, new state, scratch
                self.fill.append(tuple(at + slots[j] for j in (2, 3, 5, 6)))
                self.kinds.append(MAMBA2)
            else:
                words = _attention_words(step)
                self.fill.append(_attention_fill(step, at))
                self.kinds.append(ATTENTION)
            row = [self.kinds[-1]] + words + _mlp_words(mlp)
            rows.append(row + [0] * (ROW - len(row)))
        self.table = array.array("q", [v for row in rows for v in row])
        self.scratch = max([s.scratch for s in steps if isinstance(s, mamba2_block.BlockStep)]
                           + [m.scratch for m in mlps if m is not None] + [0])

    def __call__(self, h, states):
        B, d = self.B, self.d
        if tuple(h.shape) != (B, 1, d) or len(states) != len(self.steps):
            raise ValueError(f"the stacked step holds {len(self.steps)} layers of {B} rows of width {d}; got h "
                             f"{tuple(h.shape)} and {len(states)} states")
        table, keep, outs, scratch = self.table[:], [], [], self.scratch
        for step, kind, state, at in zip(self.steps, self.kinds, states, self.fill):
            if kind == MAMBA2:
                conv, ssm = state
                if tuple(conv.shape) != step.conv_shape or tuple(ssm.shape) != step.state_shape:
                    raise ValueError(f"a {step.name} step holds conv state {step.conv_shape}, state "
                                     f"{step.state_shape}; got {tuple(conv.shape)}, {tuple(ssm.shape)}")
                conv, ssm = conv.contiguous(), ssm.contiguous()
                new = torch.empty_like(conv), torch.empty_like(ssm)
                table[at[0]], table[at[1]], table[at[2]], table[at[3]] = conv.data_ptr(), ssm.data_ptr(), \
                    new[0].data_ptr(), new[1].data_ptr()
                keep.append((conv, ssm))
                outs.append({"ssm": new[1], "conv": new[0]})
                continue
            H, Hk, K = step.shape
            if state.k.shape[0] != B or tuple(state.k.shape[2:]) != (Hk, K) or tuple(state.v.shape[2:]) != (Hk, K):
                raise ValueError(f"an attention step holds {B} rows of {Hk} key heads of {K}; got a cache of keys "
                                 f"{tuple(state.k.shape)}, values {tuple(state.v.shape)}")
            pos = state.next_position
            new = state.opened(1)
            kc, vc, L = new._k, new._v, new._len
            if isinstance(pos, torch.Tensor):        # a ragged cache: each row's position and first column
                pos = pos.to(torch.int64).expand(B).contiguous()
                start = (new.pad - new.offset).clamp_min(0).to(torch.int64).contiguous()
                keep.append((pos, start))
                table[at[0]], table[at[6]] = pos.data_ptr(), start.data_ptr()
            else:
                table[at[7]] = pos
            table[at[1]], table[at[2]], table[at[3]], table[at[4]], table[at[5]] = \
                L, kc.data_ptr() + 4 * new._start * kc.stride(1), kc.stride(0), \
                vc.data_ptr() + 4 * new._start * vc.stride(1), vc.stride(0)
            scratch = max(scratch, 2 * B * H * K + 2 * B * Hk * K + B * max(d + 2 * H * K, H * (K + L)))
            outs.append({"kv": new})
        h2 = h.reshape(B, d).contiguous()
        h_out = h2.new_empty(B, d)
        self.kernel(len(self.steps), B, d, table.buffer_info()[0], torch.get_num_threads(), h2, h_out,
                    h2.new_empty(scratch))
        return h_out.view(B, 1, d), outs
