"""A decoding token's blocks in one C call, where each is a pre-norm Mamba or Mamba-2 block without an MLP.

A block's kept one-call step (``layers.mamba.planned_block``) still costs ~20 us of Python per block and token
besides its arithmetic - the block's and the mixer's calls, the checks of what may have changed, three new
tensors, the ctypes call - about 0.5 ms of a 24-layer step, 8-14% of an 8- or 4-bit mamba-130m token
(benchmarks/RESULTS.md). Where every block of the model is such a block, each with its step already kept at
this batch (the first token builds them the usual way), ``stacked_blocks`` runs them all as one
``ops.mamba.fused_block.StackStep``: the same C function per layer, called from one C loop, so the result is
the one the blocks give one by one (tests/models/test_stack.py holds them equal, bit for bit). The plan is kept
per blocks and rows (``layers.mamba.STACKS``) and checked at every token as the blocks check themselves: each
block, its norm and mixer the same modules without hooks and no MLP added, each kept step still valid
(``kernels.Held``: the same modules, tensors and data), no global module hooks, the sequence backend
``SingleDevice``, not compiling, the states float32 on the CPU, the kernel usable; where a check fails the
blocks run one by one (and rebuild what changed). ``ENABLED = False`` turns it off.
"""

from __future__ import annotations

import torch

from subquad import kernels
from subquad.layers import sequence
from subquad.layers.mamba import STACKS, Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.sequence import SingleDevice
from subquad.ops.decay import fused_block as mamba2_block
from subquad.ops.mamba import fused_block as mamba_block

ENABLED = True
MIXERS = (Mamba, Mamba2)
# a kept step's class -> (the stack kernel of its library, the float arguments' positions)
KINDS = {mamba_block.BlockStep: (mamba_block.STACK, (11,)),
         mamba2_block.BlockStep: (mamba2_block.STACK, mamba2_block.STACK_FLOATS)}


class Plan:
    """The blocks' kept steps at ``rows`` rows as one ``StackStep``, with what ``still`` checks per token."""

    def __init__(self, blocks, rows: int):
        self.parts, steps = [], []           # (block, norm, mixer, Held) per block
        for block in blocks:
            kept = getattr(block, "kept_step", None)
            plan = None if kept is None else kept(rows)
            if plan is None or not plan[0].valid():
                raise LookupError(block)
            self.parts.append((block, block.norm1, block.mixer, plan[0]))
            steps.append(plan[1])
        kind = KINDS.get(type(steps[0]))
        if kind is None or any(type(step) is not type(steps[0]) for step in steps):
            raise LookupError(type(steps[0]))
        self.stack = mamba_block.StackStep(kind[0], steps, kind[1])

    def still(self) -> bool:
        """Whether every block is still what ``kept_step`` accepted when this was built."""
        for block, norm, mixer, held in self.parts:
            mods = block._modules
            if mods.get("norm1") is not norm or mods.get("mixer") is not mixer or mods.get("mlp") is not None \
                    or block._forward_hooks or block._forward_pre_hooks or mixer._forward_hooks \
                    or mixer._forward_pre_hooks or not held.valid():
                return False
        return True


def _fits(block) -> bool:
    """Whether ``block`` may ever take part: a block with ``kept_step``, a Mamba or Mamba-2 mixer (their one-call
    steps) and no MLP (hooks, the kept steps and the states are checked per token)."""
    return hasattr(block, "kept_step") and type(block._modules.get("mixer")) in MIXERS \
        and block._modules.get("mlp") is None


def stacked_blocks(blocks, h, state):
    """h (B, 1, d) the embedded token, ``state`` one dict per block -> (h after the last block, the new per-block
    states) through one ``StackStep``, or None where that does not apply (the module doc): the caller then runs
    the blocks one by one."""
    if not ENABLED or h.dim() != 3 or h.shape[1] != 1 or len(state) != len(blocks) or not len(blocks) \
            or torch.compiler.is_compiling() or type(sequence.backend()) is not SingleDevice:
        return None
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return None
    B = h.shape[0]
    plans = STACKS.get(blocks)
    if plans is None:
        plans = STACKS[blocks] = {}
    members, fits = plans.get("structure", ((), False))
    if len(members) != len(blocks) or any(a is not b for a, b in zip(members, blocks)):
        members, fits = tuple(blocks), all(map(_fits, blocks))       # once per set of blocks, not per token
        plans["structure"] = members, fits
    if not fits:
        return None
    plan = plans.get(B)
    if plan is None or not plan.still():
        plans.pop(B, None)
        try:
            plan = Plan(blocks, B)
        except LookupError:                  # a block runs otherwise, or its step is not kept yet: one by one
            return None
        plans[B] = plan
    pairs = []
    for s in state:
        if type(s) is not dict or len(s) != 2:
            return None
        conv, ssm = s.get("conv"), s.get("ssm")
        if conv is None or ssm is None or conv.dtype != torch.float32 or ssm.dtype != torch.float32 \
                or not conv.is_cpu or not ssm.is_cpu:
            return None
        pairs.append((conv, ssm))
    if not kernels.usable(plan.stack.kernel, h):
        return None
    h, new = plan.stack(h, pairs)
    return h, [{"ssm": ssm, "conv": conv} for conv, ssm in new]
