"""A decoding token's runs of consecutive pre-norm Mamba or Mamba-2 blocks in one C call each.

A block's kept one-call step (``layers.mamba.planned_block``) still costs ~20 us of Python per block and token
besides its arithmetic - the block's and the mixer's calls, the checks of what may have changed, three new
tensors, the ctypes call - about 0.5 ms of a 24-layer step, 8-14% of an 8- or 4-bit mamba-130m token
(benchmarks/RESULTS.md); a hybrid's MLP after it (``layers.mlp_step``) as much again. Where consecutive blocks
are such blocks of one kind - Mamba without an MLP; Mamba-2 and softmax attention (``layers.attention_step``'s)
without one or with a SwiGLU / ReLU^2 (Bamba's, Granite 4's, Nemotron-H's blocks; a transformer's) -, each with
its steps already kept at this batch (the first token builds them the usual way), ``stacked_blocks`` runs each
run of them as one ``ops.mamba.fused_block.StackStep`` (Mamba or Mamba-2 blocks alone) or
``models.layer_stack.MixedStep`` (with attention blocks: their cache appends inside the call): the same C
functions per layer, called from one C loop, so the result is the one the blocks give one by one
(tests/models/test_stack.py, test_layer_stack.py hold them equal, bit for bit); the blocks between runs (a
windowed attention, a MoE, a lone block) run as usual. The plan is kept per run and rows
(``layers.mamba.STACKS``) and checked at every token as the blocks check themselves: each block, its norms, mixer
and MLP the same modules without hooks, each kept step still valid (``kernels.Held``: the same modules, tensors
and data), no global module hooks, the sequence backend ``SingleDevice``, not compiling, the states float32 on
the CPU (the caches as ``layers.attention_step`` takes them), the kernel usable; where a check fails that run's
blocks run one by one (and rebuild what changed). ``ENABLED = False`` turns it off; ``MIXED = False`` keeps
attention blocks out of the runs.
"""

from __future__ import annotations

import torch

from subquad import kernels
from subquad.layers import attention_step, mlp_step, sequence
from subquad.layers.attention import SoftmaxAttention
from subquad.layers.mamba import STACKS, Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.sequence import SingleDevice
from subquad.models import layer_stack
from subquad.ops import KVCache
from subquad.ops.decay import fused_block as mamba2_block
from subquad.ops.mamba import fused_block as mamba_block

ENABLED = True
MIXED = True                # Mamba-2 and attention blocks in one run (``models.layer_stack``)
MIN_RUN = 2                 # a lone block keeps its own kept call: the stack saves nothing there
MIXERS = (Mamba, Mamba2, SoftmaxAttention)
# a kept step's class -> (the stack kernel of its library, the float arguments' positions, whether its rows
# carry an MLP: kernels/mamba2_block.c)
KINDS = {mamba_block.BlockStep: (mamba_block.STACK, (11,), False),
         mamba2_block.BlockStep: (mamba2_block.STACK, mamba2_block.STACK_FLOATS, True)}


class Plan:
    """The run of ``blocks``' kept steps at ``h``'s rows as one ``StackStep``, with what ``still`` checks per
    token."""

    def __init__(self, blocks, h):
        rows = h.shape[0]
        self.parts, steps, mlps = [], [], []      # (block, norm, mixer, Held, mlp, norm2, its Held) per block
        for block in blocks:
            kept = getattr(block, "kept_step", None)
            plan = None if kept is None else kept(rows)
            if plan is None or not plan[0].valid():
                raise LookupError(block)
            mlp, norm2 = block._modules.get("mlp"), block._modules.get("norm2")
            mlp_plan = None if mlp is None else mlp_step.kept(mlp, norm2, h)
            if mlp is not None and mlp_plan is None:
                raise LookupError(mlp)
            self.parts.append((block, block.norm1, block.mixer, plan[0], mlp, norm2,
                               None if mlp_plan is None else mlp_plan[0]))
            steps.append(plan[1])
            mlps.append(None if mlp_plan is None else mlp_plan[1])
        self.attention = tuple(type(step) is attention_step.Step for step in steps)
        self.mixed = any(self.attention)
        if self.mixed:                     # a hybrid's run: Mamba-2 and attention blocks
            if any(type(step) not in (mamba2_block.BlockStep, attention_step.Step) for step in steps):
                raise LookupError(type(steps[0]))
            self.stack = layer_stack.MixedStep(steps, mlps)
            return
        kind = KINDS.get(type(steps[0]))
        if kind is None or any(type(step) is not type(steps[0]) for step in steps) \
                or (not kind[2] and any(m is not None for m in mlps)):
            raise LookupError(type(steps[0]))
        self.stack = mamba_block.StackStep(kind[0], steps, kind[1], mlps if kind[2] else None)

    @kernels.once_per_span
    def still(self) -> bool:
        """Whether every block is still what ``kept_step`` and ``layers.mlp_step.kept`` accepted when this was
        built: checked in full, or once per ``kernels.steady`` span (an attention layer's settings too: a window
        or a head gate set since, as ``layers.attention_step`` checks them per token)."""
        for (block, norm, mixer, held, mlp, norm2, mlp_held), attention in zip(self.parts, self.attention):
            mods = block._modules
            if mods.get("norm1") is not norm or mods.get("mixer") is not mixer or mods.get("mlp") is not mlp \
                    or block._forward_hooks or block._forward_pre_hooks or mixer._forward_hooks \
                    or mixer._forward_pre_hooks or not held.valid() \
                    or (attention and not attention_step.fits(mixer, norm)):
                return False
            if mlp is not None and (mods.get("norm2") is not norm2 or mlp._forward_hooks or mlp._forward_pre_hooks
                                    or not mlp_held.valid()):
                return False
        return True


def _kind(block):
    """The kind of run ``block`` may ever take part in - a block with ``kept_step``: a Mamba mixer without an MLP
    (Mamba), a Mamba-2 mixer or softmax attention the kernels compute (``layers.attention_step.fits``) without one
    or with a SwiGLU / ReLU^2 (``layers.mlp_step.fits``; Mamba2, or with ``MIXED`` both "mixed") - else None
    (hooks, the kept steps and the states are checked per token)."""
    mixer, mlp = type(block._modules.get("mixer")), block._modules.get("mlp")
    if not hasattr(block, "kept_step") or mixer not in MIXERS:
        return None
    if mixer is SoftmaxAttention and not (MIXED and attention_step.fits(block.mixer, block._modules.get("norm1"))):
        return None
    if mlp is None and mixer is Mamba:
        return mixer
    if mixer is not Mamba and (mlp is None or mlp_step.fits(mlp, block._modules.get("norm2"))):
        return "mixed" if MIXED else mixer
    return None


def runs(blocks) -> tuple:
    """(start, end) of each run of at least ``MIN_RUN`` consecutive blocks of one kind (``_kind``); a run of
    attention blocks alone (a transformer's) included."""
    kinds, out, start = [_kind(b) for b in blocks], [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] is not kinds[start]:
            if kinds[start] is not None and i - start >= MIN_RUN:
                out.append((start, i))
            start = i
    return tuple(out)


def _states(state, attention=(), rows=0) -> list | None:
    """[(conv, ssm)] of a run's per-block states - an attention block's (``attention`` True there) its KV cache -,
    or None where one is not as the kernel reads it: float32 on the CPU (a cache ``layers.attention_step``
    takes)."""
    pairs = []
    for i, s in enumerate(state):
        if attention and attention[i]:
            cache = s.get("kv") if type(s) is dict and len(s) == 1 else None
            if type(cache) is not KVCache or not attention_step.cache_ok(cache) or cache.k.shape[0] != rows:
                return None
            pairs.append(cache)
            continue
        if type(s) is not dict or len(s) != 2:
            return None
        conv, ssm = s.get("conv"), s.get("ssm")
        if conv is None or ssm is None or conv.dtype != torch.float32 or ssm.dtype != torch.float32 \
                or not conv.is_cpu or not ssm.is_cpu:
            return None
        pairs.append((conv, ssm))
    return pairs


def _run(plans, blocks, start, end, h, state):
    """The run [start, end) of ``blocks`` in one call -> (h', its new states), or None (the module doc's checks)."""
    key = (start, h.shape[0])
    plan = plans.get(key)
    if plan is None or not plan.still():
        plans.pop(key, None)
        try:
            plan = Plan(blocks[start:end], h)
        except LookupError:                  # a block runs otherwise, or its step is not kept yet: one by one
            return None
        plans[key] = plan
    pairs = _states(state[start:end], plan.attention, h.shape[0])
    if pairs is None or not kernels.usable(plan.stack.kernel, h):
        return None
    if plan.mixed:
        return plan.stack(h, pairs)
    h, new = plan.stack(h, pairs)
    return h, [{"ssm": ssm, "conv": conv} for conv, ssm in new]


def _structure(blocks) -> tuple:
    """(``blocks``' plans, their runs): the runs found once per set of blocks, not per token."""
    plans = STACKS.get(blocks)
    if plans is None:
        plans = STACKS[blocks] = {}
    members, spans = plans.get("structure", ((), ()))
    if len(members) != len(blocks) or any(a is not b for a, b in zip(members, blocks)):
        members, spans = tuple(blocks), runs(blocks)
        plans["structure"] = members, spans
    return plans, spans


def has_runs(blocks) -> bool:
    """Whether ``stacked_blocks`` may take ``blocks`` at all (a run of them exists and the stack is on)."""
    return ENABLED and bool(_structure(blocks)[1])


def stacked_blocks(blocks, h, state):
    """h (B, 1, d) the embedded token, ``state`` one dict per block -> (h after the last block, the new per-block
    states) with each run of blocks (``runs``) in one ``StackStep`` where the module doc's checks pass and the
    other blocks one by one, or None where no run applies: the caller then runs the blocks one by one."""
    if not ENABLED or h.dim() != 3 or h.shape[1] != 1 or len(state) != len(blocks) or not len(blocks) \
            or torch.compiler.is_compiling() or type(sequence.backend()) is not SingleDevice:
        return None
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return None
    plans, spans = _structure(blocks)
    if not spans:
        return None
    states, i = [], 0
    for start, end in spans + ((len(blocks), len(blocks)),):
        for j in range(i, start):                          # the blocks before the run, one by one
            h, s = blocks[j](h, state[j], carry={})
            states.append(s)
        out = None if start == end else _run(plans, blocks, start, end, h, state)
        if out is None:
            for j in range(start, end):
                h, s = blocks[j](h, state[j], carry={})
                states.append(s)
        else:
            h, new = out
            states += new
        i = end
    return h, states
