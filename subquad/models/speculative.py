"""Speculative decoding: draft k tokens cheaply, verify them in one forward, keep the accepted prefix exactly.

    out, state = model.generate(prompt, 200, temperature=0, speculative="ngram", draft_tokens=4)
    model.speculation_stats.tokens_per_step        # tokens emitted per model forward while decoding

Each step has t0, the last emitted token (not yet fed). A drafter proposes d_1..d_k; ``verify`` runs
[t0, d_1..d_k] through the model from the state, giving the distributions p_0..p_k (p_i: the token after d_i).
The rule (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318) with a deterministic
drafter (q one-hot at d_i): accept d_{i+1} with probability p_i(d_{i+1}); at the first rejection draw from p_i
with d_{i+1} removed and renormalised; if all k are accepted draw a bonus token from p_k. Each emitted token is
then distributed exactly as in plain sampling; greedy (temperature 0) accepts d_{i+1} iff it is argmax p_i, so
the output is plain greedy decoding's (up to the rounding of a k-token forward against one-token steps: exact in
float64 tests, a near-tie in float32 may differ). With j drafts accepted, the state keeps the first j + 1
verified tokens: attention truncates its KV caches; a mixer whose state is kept per token ("states") - after
``compile_decode``, where every part of the model is (``keeps_states``), the verification is a compiled graph
that keeps each recurrent layer's state after every token - takes the j + 1-th (``KeptStates``); otherwise any
other mixer (and a stateful MLP) replays its own kept inputs, recorded during verification, from its state
before (``Verification``; ``subquad.layers.rollback``; a layer's parts and their kinds: ``Block.state_parts``).

The loop is ``generate``'s (``models.generate._decode_speculative``, beside the plain one); this module holds its
parts. Two drafters: prompt lookup (``NgramDrafter``, ``ngram_draft``: the continuation of the latest earlier
occurrence of the last n tokens of prompt + output, n from ``max_ngram`` down to 1) and a smaller model with the
same vocabulary (``ModelDrafter``: its greedy continuation, its own state kept in step with the target's). Both
are deterministic given the tokens so far (q one-hot), so the rule above is exact for either. In a batch each
row keeps its own accepted prefix: when the rows' counts differ, each row's states are picked at its own count
and its KV caches drop their own number (``KVCache.rollback_rows``), or every part replays its rows' kept inputs
packed in one row (``cu_seqlens``), leaving a ragged state as a packed prefill does (``accept`` with a list).
When a batch's drafts keep failing, drafting pauses for 1, 2, 4, ... up to ``MAX_PAUSE`` steps (plain one-token
steps), so a text without repetitions decodes at about plain speed; and so it does while a verification costs more
wall time per emitted token than a plain step (``Pacer``: an eager verification against a compiled step, say). One
row drafting by prompt lookup drafts first, and the pacer alone judges its drafts, by the length of their match.
"""

from __future__ import annotations

import math
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from subquad.layers import sequence
from subquad.layers.linear import C_ROWS
from subquad.layers.rollback import PER_TOKEN, pick, roll_back, truncate
from subquad.models.mode import decoding
from subquad.models.sampling import argmax
from subquad.models.state import ModelState
from subquad.ops import KVCache

SPECULATIVE = ("ngram", "mtp")   # by name; a draft model is passed as itself
MAX_NGRAM = 3      # the longest suffix prompt lookup matches
MAX_PAUSE = 16     # plain steps after repeated failed drafts, at most


class Pacer:
    """Whether the next decoding step verifies drafts: only while verifying pays in wall time.

    A verification at a batch of B rows that took t_v seconds (drafting included) and emitted g tokens per row
    pays when g >= t_v / t_p(B), with t_p(B) a plain step's seconds at that batch (a compiled step can cost far
    less than an eager verification: benchmarks/RESULTS.md, "Speculative decoding measured"). The pacer keeps
    r = t_v / t_p(B) and g as moving averages (weight ``ALPHA`` on the newest) and judges that verifying pays
    while either the averages or the last verification's own r and g say so (acceptance comes in runs: a text
    that starts repeating itself pays at once, not after the averages catch up), so a batch that grows or shrinks
    (the server's rows joining and leaving) is judged against plain steps of its own size: t_p(B) is the plain
    step measured at B, else at the nearest batch measured. Each plain step at B sets t_p(B) to its time, but
    never more than ``GROWTH`` times the last (a step that compiled a graph is forgotten at the next one), and
    caps t_p at every smaller batch (a smaller batch costs no more: a graph built at batch 1 is forgotten once a
    larger batch is measured). The plain step right after a verification is not one of them: what it costs over
    t_p (the compiled step taking a state the verification left in another layout) is the verification's, added
    to r. Nothing is verified before ``WARMUP`` plain steps are measured (the first may have compiled the step),
    and after ``PROBE`` verifications in a row a plain step measures t_p again (two: the first is the last
    verification's aftermath). While verifying does not pay, drafting waits 1, 2, 4, ... up to ``MAX_WAIT``
    plain steps, then verifies once more: acceptance and costs change with the text and the batch - and at least
    as many as keep what that failed verification cost beyond a plain step's time per token (r - g plain steps,
    or the averages' r - g where less: one slow verification does not set it alone) within ``BUDGET`` of the
    plain steps' time: a verification that costs 4 plain steps for 1 token waits 60 steps, so probing a text
    without repetitions costs about 5%, not the 16-22% of doubling from one step (a batch of 8 that replays its
    verifications, benchmarks/RESULTS.md). Each further verification in a row that does not pay halves that
    budget, down to ``BUDGET`` / 2 ** ``BACKOFF``: where verifying never pays (a batch whose verification costs
    twice a step) probing costs ever less of the time, and a verification that pays sets the budget back. No
    wait is longer than ``LONGEST`` steps.

    A step during which a graph was compiled or loaded (the first verification at a shape, a step recompiled)
    measures that, not the step: it is not heard (``start``, ``graphs_built``) - a verification that loaded its
    graph once looked 53 plain steps long. ``generate`` keeps a model's pacer between calls (``pacer_for``).

    A drafter whose drafts cost nothing to make (prompt lookup) drafts first and asks with a ``key`` - its match's
    n - and each key keeps its own gain and waits (the ratio is the verification's cost, shared): a text's
    3-token matches may pay while its 1-token matches do not, and failed 1-token drafts then no longer hold back
    the 3-token ones (at one row of the edit task, drafts by a 3-token match kept 3.6 tokens, by a 1-token match
    1.1: benchmarks/RESULTS.md, "Prompt lookup judged by its match")."""

    ALPHA = 0.3
    GROWTH = 1.5
    WARMUP = 2
    PROBE = 16
    MAX_WAIT = 64
    BUDGET = 0.05
    BACKOFF = 4
    LONGEST = 4096

    def __init__(self):
        self.plain: dict[int, float] = {}   # batch -> a plain step's seconds there
        self.ratio = None
        self.keys: dict = {}               # key -> _Judged: its gain, its last verification, its waits
        self.key = None                    # the last verification's key
        self.measured_plain = 0            # plain steps measured (aftermaths not counted)
        self.since = 0                     # verifications since the last plain step
        self.after = False                 # the last step was a verification
        self.built = None                  # graphs built when the step being timed began (``start``)

    # the judgement of key None (every caller without keys)
    gain = property(lambda self: self._get(None).gain)
    pause = property(lambda self: self._get(None).pause)
    wait = property(lambda self: self._get(None).wait)

    def _get(self, key) -> "_Judged":
        return self.keys.get(key) or _Judged()

    def t_plain(self, batch: int) -> float:
        """A plain step's seconds at ``batch`` rows (the nearest batch measured; the larger on a tie)."""
        return self.plain[min(self.plain, key=lambda b: (abs(b - batch), -b))]

    def want(self, key=None) -> bool:
        """Whether to draft and verify at this step (a plain step otherwise); a step passes for every key."""
        if self.measured_plain < self.WARMUP:
            return False
        j = self.keys.get(key)
        self.passed(j)
        if j is not None and j.wait:
            j.wait -= 1
            return False
        return self.since < self.PROBE                 # else a plain step that measures t_p

    def verifies(self, drafted: bool, key) -> bool:
        """For a drafter that drafts before asking (prompt lookup, by its match's n as ``key``): whether to verify
        what it drafted; a step with nothing drafted only counts down the keys' waits."""
        if not drafted:
            self.passed()
            return False
        return self.want(key)

    def passed(self, but=None) -> None:
        """A step went by without asking (nothing was drafted): every key's wait counts it."""
        for j in self.keys.values():
            if j is not but and j.wait:
                j.wait -= 1

    def start(self) -> float:
        """The clock at a step's start (``time.perf_counter``); the step is heard only if no graph is built in it."""
        self.built = graphs_built()
        return time.perf_counter()

    def measured(self, seconds: float, tokens_per_row: float | None = None, batch: int = 1, key=None) -> None:
        """A plain step's seconds (``tokens_per_row`` None) or a verification's and the tokens it emitted per
        row, at ``batch`` rows, of drafts asked for with ``key`` (not heard if a graph was built since
        ``start``)."""
        if self.built is not None and graphs_built() != self.built:
            self.built = None
            return
        if tokens_per_row is None:
            if self.after and self.ratio is not None:             # the verification's aftermath (a probe goes on)
                self.after = False
                t = self.t_plain(batch)
                extra = max(0.0, seconds - t) / t
                self.ratio += self.ALPHA * extra
                j = self.keys[self.key]
                j.last = (j.last[0], j.last[1] + extra)
                if not j.wait:                                    # judged to pay: judged again with it
                    self._judge(j)
                return
            self.after, self.since = False, 0
            self.measured_plain += 1
            last = self.plain.get(batch)
            self.plain[batch] = seconds if last is None else min(seconds, self.GROWTH * last)
            for b in self.plain:
                if b < batch:
                    self.plain[b] = min(self.plain[b], self.plain[batch])
            return
        self.since += 1
        self.after = True
        if not self.plain:                  # verified before any plain step (want() overridden): nothing to judge
            return
        a, r = self.ALPHA, seconds / self.t_plain(batch)
        self.ratio = r if self.ratio is None else (1 - a) * self.ratio + a * r
        j = self.keys.get(key)
        if j is None:
            j = self.keys[key] = _Judged()
        self.key = key
        j.gain = tokens_per_row if j.gain is None else (1 - a) * j.gain + a * tokens_per_row
        j.last = (tokens_per_row, r)
        self._judge(j)

    def _judge(self, j: "_Judged") -> None:
        if j.gain < self.ratio and j.last[0] < j.last[1]:
            j.fails += 1
            budget = self.BUDGET / 2 ** min(j.fails - 1, self.BACKOFF)
            lost = min(j.last[1] - j.last[0], self.ratio - j.gain)     # one slow outlier does not set it alone
            j.wait = min(max(j.pause, math.ceil(lost / budget)), self.LONGEST)
        else:
            j.wait = j.fails = 0


def graphs_built() -> int:
    """How many graphs this process has compiled or loaded: dynamo's, and ``compile_decode``'s saved ones
    (``CompiledStep.made``); 0 while neither module is imported (eager decoding)."""
    utils, decode = sys.modules.get("torch._dynamo.utils"), sys.modules.get("subquad.models.decode")
    return ((0 if utils is None else utils.counters["stats"]["unique_graphs"])
            + (0 if decode is None else decode.CompiledStep.made))


_PACERS = weakref.WeakKeyDictionary()     # model -> {(drafter, draft_tokens): Pacer} (``pacer_for``)


def pacer_for(model, drafter, draft_tokens: int) -> Pacer:
    """The pacer ``generate`` asks when ``model`` drafts with ``drafter`` ("ngram", "mtp" or a draft model) up to
    ``draft_tokens``: kept between calls (outside the model, weakly), as a server's engine keeps its own between
    requests - what a verification costs against a plain step at each batch, and each key's judgement and
    waits, measured once, so a batch whose verifications never pay does not probe again at every call. A call
    starts without a verification's aftermath."""
    by = _PACERS.get(model)
    if by is None:
        by = _PACERS[model] = {}
    key = (drafter if isinstance(drafter, str) else id(drafter), draft_tokens)
    pacer = by.get(key)
    if pacer is None:
        pacer = by[key] = Pacer()
    pacer.after, pacer.since = False, 0
    return pacer


class _Judged:
    """One key's judgement (``Pacer``): its gain's moving average, its last verification's (g, r), how many
    steps drafting with it waits, and how many of its verifications in a row did not pay (``pause``, the least
    wait, doubles with them: 1, 2, 4, ... ``Pacer.MAX_WAIT``)."""

    __slots__ = ("gain", "last", "wait", "fails")

    def __init__(self):
        self.gain = self.last = None
        self.wait = self.fails = 0

    @property
    def pause(self) -> int:
        return min(2 ** (self.fails - 1), Pacer.MAX_WAIT) if self.fails else 0


class Verification:
    """What ``verify`` keeps to roll the state back: the state before and after all T tokens, and for each part of
    each layer's state (``Block.state_parts``: a mixer, a stateful MLP) its input, the cross-layer ``carry`` it
    saw (both (B, T, ...) per token) and its new state."""

    def __init__(self, model, before, after, taps, T):
        self.model, self.before, self.after, self.taps, self.T = model, before, after, taps, T

    @torch.no_grad()
    def accept(self, keep) -> ModelState:
        """The model state after the first ``keep`` (0..T) verified tokens, equal to prefilling only those: each
        part of each layer truncated or replayed as it declares (a replay runs that part alone over its kept
        inputs). ``keep`` a list of one count per row (1..T) keeps a different prefix in each row: every part
        replays its rows' kept inputs packed in one row (``cu_seqlens``), leaving a ragged state as a packed
        prefill does. Call it once: a truncated KV cache reuses the verification's buffers."""
        keep, rows = _check_keep(keep, self.taps[0][0].x.shape[0], self.T)
        dev = self.taps[0][0].x.device
        pos = getattr(self.before, "pos", 0)
        if rows:
            cu = torch.tensor([0] + list(keep), device=dev).cumsum(0)
            state = ModelState(pos=torch.as_tensor(pos, device=dev) + torch.tensor(keep, device=dev))
        else:
            state = ModelState(pos=pos + keep)
        for i, taps in enumerate(self.taps):
            layer = {}
            for tap in taps:
                before = {k[len(tap.prefix):]: v for k, v in self.before[i].items()
                          if k.startswith(tap.prefix) and k[len(tap.prefix):] in tap.state}
                if rows:
                    new = tap.run(_packed(tap.x, keep), before, {k: _packed(v, keep) for k, v in tap.carry.items()}, cu)
                else:
                    new = roll_back(tap.kind, before, tap.state, self.T, keep,
                                    lambda j, tap=tap, before=before: tap.run(
                                        tap.x[:, :j], before, {k: v[:, :j] for k, v in tap.carry.items()}))
                layer.update({tap.prefix + k: v for k, v in new.items()})
            # entries in the order the state before held them (a prefill's), not the parts' order: a shared
            # block's part comes first in ``state_parts``
            order = [k for k in self.before[i] if k in layer]
            state.append({**{k: layer[k] for k in order}, **layer})
        return state


def _packed(t, keeps):
    """(B, T, ...) -> (1, sum(keeps), ...): each row's first keeps[b] positions, one after another."""
    return torch.cat([t[b, :n] for b, n in enumerate(keeps)]).unsqueeze(0)


class _Tap:
    """One part of a layer's state during verification (``Block.state_parts``): hooks on its module record its
    input x, the carry it was handed (a copy: a layer may add to it) and its new state."""

    def __init__(self, module, kind, prefix):
        self.module, self.kind, self.prefix = module, kind, prefix
        self.depth = 0                                   # calls in progress: only the outermost one is recorded

    def before_call(self, module, args, kwargs):
        if self.depth == 0:
            carry = kwargs.get("carry")
            self.carry = {} if carry is None else dict(carry)
            self.carried = "carry" in kwargs             # an MLP takes no carry
        self.depth += 1

    def after_call(self, module, args, kwargs, output):
        self.depth -= 1
        if self.depth == 0:
            self.x, self.state = args[0], output[1]

    def run(self, x, state, carry, cu_seqlens=None) -> dict:
        """The module over x from ``state`` -> its new state (a replay)."""
        extra = {"carry": carry} if self.carried else {}
        return self.module(x, state, cu_seqlens=cu_seqlens, **extra)[1]


def _check_keep(keep, B, T):
    """keep as an int, or as a list of one count per row when they differ; ValueError for anything else."""
    rows = isinstance(keep, (list, tuple))
    if rows and (len(keep) != B or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= T
                                       for n in keep)):
        raise ValueError(f"keep per row must be {B} ints in [1, {T}], got {keep!r}")
    if rows and len(set(keep)) == 1:
        keep, rows = keep[0], False
    if not rows and (isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= T):
        raise ValueError(f"keep must be an int in [0, {T}] (the verified tokens), got {keep!r}")
    return keep, rows


class KeptStates:
    """The rollback of a verification that kept the states per token (``verify``'s "compiled" and "states"):
    each "states" part left its entries after every verified token, (B, T, ...), so accepting j takes the j-th
    (``layers.rollback.pick``: per row, a gather), and a KV cache drops the rest (``truncate``) - nothing runs
    again."""

    def __init__(self, model, before, after, tokens):
        self.model, self.before, self.after = model, before, after
        self.B, self.T = tokens.shape
        self.device = tokens.device

    @torch.no_grad()
    def accept(self, keep) -> ModelState:
        """As ``Verification.accept``: the state after the first ``keep`` verified tokens (an int, or one count
        per row; a KV cache then drops a count per row, ``KVCache.rollback_rows``)."""
        keep, rows = _check_keep(keep, self.B, self.T)
        pos = getattr(self.before, "pos", 0)
        if rows:
            dev = self.device
            keep = torch.tensor(keep, device=dev)
            state = ModelState(pos=torch.as_tensor(pos, device=dev) + keep)
        else:
            state = ModelState(pos=pos + keep)
        for before, after in zip(self.before, self.after):
            layer = {}
            for key, v in after.items():
                b = before[key]
                if isinstance(v, KVCache):
                    if rows:                          # each row drops its own count (no window: keeps_states)
                        layer[key] = v.rollback_rows([self.T - n for n in keep.tolist()])
                        continue
                    kept = truncate({key: b}, {key: v}, self.T, keep)
                    if kept is None:
                        raise RuntimeError(f"a verification kept per token cannot roll back KV cache {key!r} to {keep}")
                    layer[key] = kept[key]
                    continue
                if v.shape[:2] != (b.shape[0], self.T) or v.shape[2:] != b.shape[1:]:
                    raise RuntimeError(f"state entry {key!r} of a verification kept per token is {tuple(v.shape)}, not "
                                       f"kept per token from {tuple(b.shape)}: its mixer is not \"states\"")
                layer[key] = pick(b, v, keep)
            state.append(layer)
        return state


def keeps_states(model, tokens) -> bool:
    """Whether a verification of ``tokens`` (B, T) can keep the state after every token instead of replaying:
    every part of the model's state is a "states" part (``layers.rollback``) or a KV cache - without a window
    (rows that keep different counts: ``KVCache.rollback_rows``), or at batch 1 with a window holding all T."""
    B, T = tokens.shape
    for block in model.blocks:
        for module, kind, _ in block.state_parts():
            if kind == "truncate":
                window = getattr(module, "window", None)
                if window is not None and (B > 1 or window < T):
                    return False
            elif kind != "states":
                return False
    return True


def _one_call(model, tokens) -> bool:
    """Every "states" part of the model keeps its per-token states of ``tokens`` (B, T) in one call eagerly
    (``per_token_states``; a part that does so only through its pre-norm block's call, ``block_tokens``: Mamba-2,
    when its block is one and B T is within the call's ``layers.linear.C_ROWS``)."""
    def one(block, module):
        if not getattr(module, "per_token_states", False):
            return False
        return not getattr(module, "block_tokens", False) or (
            getattr(block, "one_call", False) and block.mixer is module and not block.stateful_mlp
            and tokens.numel() <= C_ROWS)

    return all(kind != "states" or one(block, module)
               for block in model.blocks for module, kind, _ in block.state_parts())


def _mamba_calls(model, tokens) -> bool:
    """Every block is a plain pre-norm Mamba-1 block whose verification of ``tokens`` runs as one C call
    (``ops.mamba.fused_block.TokensStep``: float32 on the CPU, kernels built, rows times tokens within
    ``layers.linear.C_ROWS``) - faster eagerly than the compiled verification (1.21x a compiled step against
    1.41x for 8 tokens at mamba-130m's shape, benchmarks/RESULTS.md) and with no graph to build (~3 minutes)."""
    from subquad.layers.mamba import Mamba
    from subquad.ops.mamba import fused_block

    return tokens.numel() <= C_ROWS and fused_block.TOKENS.available() and all(
        getattr(b, "one_call", False) and type(b.mixer) is Mamba and b.mlp is None and b.mixer.per_token_states
        for b in model.blocks)


def draft_budget(model, batch: int, k: int) -> int:
    """The most tokens each of ``batch`` rows drafts when asked for ``k``: on the CPU no more than keeps the
    verification's rows x tokens within ``layers.linear.C_ROWS`` (at least one). Up to there its products read
    each weight once for all rows at a decoding step's cost (the C kernels, a Mamba block's one call keeping the
    states); past it every row costs compute, and a Mamba-2 block's verification replays: at 8 rows of a Bamba-like
    hybrid at mamba-130m's width 4 drafts (40 rows) cost 8.3x a plain step, 1 draft (16 rows) 1.7x
    (benchmarks/RESULTS.md, "Drafts by batch"). A compiled verification is a graph per ``k``: its callers
    pad to ``compiled_budget``'s."""
    if k < 1 or next(model.parameters()).device.type != "cpu":
        return k
    return max(1, min(k, C_ROWS // max(batch, 1) - 1))


def drafting_plan(model, batch: int, k: int, hooked: bool = False, keeps=None) -> tuple[bool, int]:
    """(whether the verification is the compiled one, drafts per row) for ``batch`` rows asked for ``k``: after
    ``compile_decode``, with no hooks to feed (the MTP head reads eager forwards) and every part keeping its
    states (``keeps_states``, or ``keeps(rows, k)`` - a caller's cache of it), the compiled graph padded to
    ``compiled_budget``; else ``draft_budget`` (``generate`` and the server alike)."""
    kf = compiled_budget(model, batch, k)
    fixed = (not hooked and getattr(model, "_decode_step", None) is not None
             and (keeps(batch, kf) if keeps is not None
                  else keeps_states(model, torch.zeros(batch, kf + 1, dtype=torch.long))))
    return fixed, kf if fixed else draft_budget(model, batch, k)


def compiled_budget(model, batch: int, k: int) -> int:
    """The drafts per row a compiled verification pads to at ``batch`` rows when asked for ``k``: ``k`` while
    ``draft_budget`` allows it, else 1 - two graphs per batch class (one row, more), not one per batch size. At 8
    rows of ``bench_speculative.py``'s target a 2-token verification costs ~1.5x a plain step against ~2.7x for
    7 tokens (benchmarks/RESULTS.md, "Prompt lookup judged by its match"): a probe that does not pay loses little."""
    return k if draft_budget(model, batch, k) >= k else 1


HOW = ("compiled", "states", "replay")


@torch.no_grad()
def verify(model, tokens, state, how: str | None = None):
    """tokens (B, T) after ``state`` (a model state, not None) -> (logits (B, T, vocab), the rollback: a
    ``Verification`` or ``KeptStates``): the same logits and state as ``model.prefill(tokens, state)``, keeping
    what ``accept`` needs. ``how``:

        "compiled"   the compiled verification (``CompiledStep.verifier``, after ``compile_decode``), keeping
                     the states per token (``keeps_states``); it fires no hooks
        "states"     the same eagerly: the prefill under ``layers.rollback.PER_TOKEN``
        "replay"     the prefill with taps that record each part's inputs, replayed at ``accept``
        None         "compiled" where the model decodes compiled and ``keeps_states``, but "states" for a model of
                     plain Mamba-1 blocks each of which runs as one C call (``_mamba_calls``: faster than the
                     graph); eagerly "states" where every "states" part keeps them in one call
                     (``per_token_states``: Mamba's scan kernel; 1.3x an eager step for 8 tokens at
                     mamba-130m's shape against the replay's 4.4x, benchmarks/bench_verify.py), else "replay"
    """
    if state is None:
        raise ValueError("verify needs the state the tokens continue (prefill the prompt first)")
    if how is not None and how not in HOW:
        raise ValueError(f"how must be one of {HOW} or None, got {how!r}")
    with decoding():                            # int8: fbgemm's kernel at any batch (models.quant)
        return _verify(model, tokens, state, how)


def _verify(model, tokens, state, how):
    step = getattr(model, "_decode_step", None)
    kept = how != "replay" and keeps_states(model, tokens)
    if how is None:
        if not kept:
            how = "replay"
        elif step is not None and not _mamba_calls(model, tokens):
            how = "compiled"
        else:
            how = "states" if _one_call(model, tokens) else "replay"
    if how != "replay":
        if not kept:
            raise ValueError(f"how={how!r} needs every part of the state kept per token (keeps_states): this model's "
                             f"parts at batch {tokens.shape[0]} and {tokens.shape[1]} tokens are not")
        if how == "compiled":
            if step is None:
                raise ValueError("how='compiled' needs compile_decode(model) first")
            logits, after = step.verifier()(tokens, state)
        else:
            with sequence.use(PER_TOKEN):
                logits, after = model.prefill(tokens, state)
        return logits, KeptStates(model, state, after, tokens)
    taps = [[_Tap(*part) for part in block.state_parts()] for block in model.blocks]
    hooks = []
    try:
        for tap in (t for layer in taps for t in layer):
            hooks.append(tap.module.register_forward_pre_hook(tap.before_call, with_kwargs=True))
            hooks.append(tap.module.register_forward_hook(tap.after_call, with_kwargs=True))
        logits, after = model.prefill(tokens, state)
    finally:
        for h in hooks:
            h.remove()
    return logits, Verification(model, state, after, taps, tokens.shape[1])


def ngram_draft(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Prompt lookup: up to ``k`` tokens following the latest earlier occurrence of the last n tokens of
    ``tokens`` that has k tokens after it (else the occurrence with the most), for the largest n <= ``max_ngram``
    that occurs earlier; [] when none does. (The latest occurrence alone would draft one token in a run
    "a a a a": its continuation is the suffix.)"""
    return lookup(tokens, k, max_ngram)[0]


def lookup(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """``ngram_draft``'s draft and the n it matched (0: none) - how far to trust it: a longer match's drafts are
    accepted more (``Pacer``'s keys; benchmarks/RESULTS.md)."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail, best = tokens[L - n:], None
        for start in range(L - n - 1, -1, -1):            # latest first; the suffix itself excluded
            if tokens[start:start + n] == tail:
                follow = tokens[start + n:start + n + k]
                if len(follow) == k:
                    return follow, n
                best = follow if best is None or len(follow) > len(best) else best
        if best is not None:
            return best, n
    return [], 0


class PromptLookup:
    """``ngram_draft`` over one growing sequence: the plain search while it is short, then (from ``index_from``
    tokens) an index of every n-gram's start positions (n <= ``max_ngram``), kept up as tokens are appended, so a
    draft costs O(max_ngram + k) whatever the length. ``ngram_draft`` is the specification; tests compare them."""

    def __init__(self, tokens=(), max_ngram: int = MAX_NGRAM, index_from: int = 256):
        self.tokens, self.max_ngram, self.index_from = list(tokens), max_ngram, index_from
        self.starts = None                                   # starts[n][n-gram]: its start positions, in order
        self.n = 0                                           # the n the last draft matched (0: none)
        self.indexed = 0                                     # tokens whose n-grams ending there are indexed

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def _index(self) -> None:
        if self.starts is None:
            self.starts = [{} for _ in range(self.max_ngram + 1)]
        toks = self.tokens
        for L in range(self.indexed + 1, len(toks) + 1):
            for n in range(1, min(self.max_ngram, L) + 1):
                self.starts[n].setdefault(tuple(toks[L - n:L]), []).append(L - n)
        self.indexed = len(toks)

    def draft(self, k: int) -> list[int]:
        """``ngram_draft`` of the tokens so far; ``self.n`` is then the n it matched (``lookup``)."""
        out, self.n = self._draft(k)
        return out

    def _draft(self, k: int) -> tuple[list[int], int]:
        toks, L = self.tokens, len(self.tokens)
        if L < self.index_from:
            return lookup(toks, k, self.max_ngram)
        self._index()
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            best = None
            for start in reversed(self.starts[n].get(tuple(toks[L - n:]), [])[:-1]):   # the suffix itself last
                follow = toks[start + n:start + n + k]
                if len(follow) == k:          # reached after at most k shorter ones: those start near the end
                    return follow, n
                best = follow if best is None or len(follow) > len(best) else best
            if best is not None:
                return best, n
        return [], 0


class NgramDrafter:
    """Prompt lookup over each row's prompt and emitted tokens (``PromptLookup``). Its drafts cost next to nothing,
    so a row drafts before the pacer is asked, which judges them by their match's n (``keyed``, ``key``)."""

    name = "ngram"
    needs_hidden = False
    keyed = True

    def __init__(self, prompts, max_ngram: int = MAX_NGRAM):
        self.hist = [PromptLookup(p, max_ngram) for p in prompts]

    def append(self, i: int, token: int) -> None:
        """Row i emitted ``token``."""
        self.hist[i].append(token)

    def propose(self, feed: list[int], active: list[int], k: int) -> list[list[int]]:
        """Up to k drafts for each active row (the others: []); ``feed`` the tokens the verification starts with."""
        return [self.hist[i].draft(k) if i in active else [] for i in range(len(self.hist))]

    def key(self, i: int) -> int:
        """How row i's last draft was found: the n of its match (``lookup``), the ``Pacer``'s key for it."""
        return self.hist[i].n

    def settle(self, feed, drafts, keeps, hidden=None) -> None:
        """The target kept ``keeps[i]`` of row i's [feed[i], drafts...] (nothing to do: the history is appended)."""


class ModelDrafter:
    """A smaller model with the target's vocabulary drafts its greedy continuation.

    Its state, with the tokens in ``pending``, covers the tokens the target's state covers (each row's tokens
    before the one to feed): prefilled on the prompts; a plain step of the target only appends its fed tokens to
    ``pending`` (the draft model does not run while the pacer has drafting wait), and the next ``propose`` first
    prefills them, one forward for all. ``propose`` then runs k one-token steps, keeping the state after each,
    and ``settle`` takes the one after the tokens the target kept - the (n)th kept state when every row kept
    n <= k tokens, one more step when all k drafts and the fed token were kept, and a verification of the draft
    itself rolled back per row (``verify(...).accept(keeps)``) when rows kept different numbers. With
    ``matchers`` set (``generate``'s ``response_format``: a ``models.constrain.RowMatcher`` per row, or None)
    each row's drafts are held to its grammar: the greedy token among those it allows, the matcher advanced
    through the drafts and rolled back after."""

    name = "model"
    needs_hidden = False
    matchers = None

    def __init__(self, draft, target, prompts):
        check_speculative(draft, target)
        dev = draft.embed.weight.device
        self.model, self.dev, self.was_training = draft, dev, draft.training
        draft.eval()
        if len({len(p) for p in prompts}) == 1:
            _, self.state = draft.prefill(torch.tensor(prompts, device=dev), logits="last")
        else:
            lens = torch.tensor([len(p) for p in prompts])
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev)
            packed = torch.tensor([t for p in prompts for t in p], device=dev).view(1, -1)
            _, self.state = draft.prefill(packed, cu_seqlens=cu, logits="last")
        self.states, self.pending = [], []

    def append(self, i: int, token: int) -> None:
        pass

    def catch_up(self) -> None:
        """Prefill the tokens plain steps fed (``pending``: one list of every row's token per step) into the state."""
        if self.pending:
            ids = torch.tensor(self.pending, device=self.dev).T.contiguous()      # (B, steps)
            _, self.state = self.model.prefill(ids, self.state, logits="last")
            self.pending = []

    def propose(self, feed: list[int], active: list[int], k: int) -> list[list[int]]:
        self.catch_up()
        s, tok, out = self.state, torch.tensor(feed, device=self.dev), []
        self.states = []
        held = [m if m is not None and i in active else None for i, m in enumerate(self.matchers or [])]
        taken = [0] * len(held)
        for _ in range(k):
            logits, s = self.model.step(tok, s)
            masks = [m.allowed() if m is not None and not m.done else None for m in held]
            if any(a is not None and a.any() for a in masks):      # the grammar's tokens only, while it goes on
                logits = logits.clone()
                for i, a in enumerate(masks):
                    if a is not None and a.any():
                        logits[i].masked_fill_(~a.to(logits.device), float("-inf"))
            tok = argmax(logits)
            for i, a in enumerate(masks):
                if a is not None and bool(a[int(tok[i])]):
                    held[i].consume(int(tok[i]))
                    taken[i] += 1
            self.states.append(s)
            out.append(tok)
        for m, n in zip(held, taken):
            if n:
                m.rollback(n)
        drafts = torch.stack(out, 1).tolist() if out else [[] for _ in feed]
        self.drafted = drafts                              # every row's, finished ones included (settle feeds them)
        return [drafts[i] if i in active else [] for i in range(len(feed))]

    def settle(self, feed, drafts, keeps, hidden=None) -> None:
        """The target kept ``keeps[i]`` tokens of row i's [feed[i], drafts[i]...] (``keeps`` an int: every row
        the same; ``drafts`` None: a plain step, which kept feed)."""
        if drafts is None:
            self.pending.append(list(feed))
            return
        drafts = self.drafted
        k = len(drafts[0])
        if isinstance(keeps, (list, tuple)) and len(set(keeps)) == 1:
            keeps = keeps[0]
        if isinstance(keeps, int):
            if keeps <= k:
                self.state = self.states[keeps - 1]
            else:                                          # every draft kept: feed the last one too
                _, self.state = self.model.step(torch.tensor([d[-1] for d in drafts], device=self.dev),
                                                self.states[-1])
        else:
            ids = torch.tensor([[f] + d for f, d in zip(feed, drafts, strict=True)], device=self.dev)
            _, ver = verify(self.model, ids, self.state)
            self.state = ver.accept(list(keeps))
        self.states = []

    def close(self) -> None:
        self.model.train(self.was_training)


class MTPDrafter:
    """The checkpoint's own multi-token-prediction head drafts (``models.mtp``; ``model.mtp``): its greedy
    next-next token from the model's hidden state and the token after it, then from its own output.

    The head's KV cache holds one pair per token the model has consumed (pair i: the model's final-normed hidden
    state at i and the token at i + 1). The pairs whose hidden state or next token has just arrived wait in
    ``pending`` (per row: hidden rows, tokens) and go through the head in one forward (packed when rows wait
    with different counts) when the next draft is asked: the tokens come from ``append`` (every emitted token),
    the hidden states from ``settle`` (the verified positions kept, read from the model's forward by
    ``capture_hidden``). Drafting chains the head on its own output from a fork of that cache, which is
    never kept: the verified pairs replace the drafted ones."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model, prompts, hidden, cu_seqlens=None):
        self.model, self.head = model, model.mtp
        self.dev = model.embed.weight.device
        h = model.norm(hidden)
        if cu_seqlens is None:
            rows = list(h.unbind(0))
        else:
            cu = cu_seqlens.tolist()
            rows = [h[0, cu[b]:cu[b + 1]] for b in range(len(prompts))]
        self.pending = [([r], list(p[1:])) for r, p in zip(rows, prompts, strict=True)]
        self.cache, self.last = None, None

    def append(self, i: int, token: int) -> None:
        self.pending[i][1].append(token)

    def _flush(self) -> None:
        """Run the pending pairs through the head: ``cache`` then covers them, ``last`` = (logits (B, vocab),
        u (B, d)) at each row's last pair."""
        hs = [torch.cat(h) for h, _ in self.pending]
        n = [len(h) for h in hs]
        toks = [(t + [0] * m)[:m] for (_, t), m in zip(self.pending, n, strict=True)]   # finished rows: padding
        head, model = self.head, self.model
        if len(set(n)) == 1:
            logits, u, self.cache = head(model, torch.stack(hs), torch.tensor(toks, device=self.dev), self.cache)
            self.last = logits[:, -1], u[:, -1]
        else:
            cu = torch.tensor([0] + n, device=self.dev).cumsum(0)
            flat = torch.tensor([t for row in toks for t in row], device=self.dev)
            logits, u, self.cache = head(model, torch.cat(hs)[None], flat[None], self.cache, cu_seqlens=cu)
            self.last = logits[0, cu[1:] - 1], u[0, cu[1:] - 1]
        self.pending = [([], []) for _ in n]

    def propose(self, feed: list[int], active: list[int], k: int) -> list[list[int]]:
        if any(h for h, _ in self.pending):
            self._flush()
        logits, u = self.last
        tok = argmax(logits)
        out, s = [tok], self.cache
        for _ in range(k - 1):
            logits, u, s = self.head(self.model, u[:, None], tok[:, None], s)
            logits, u = logits[:, -1], u[:, -1]
            tok = argmax(logits)
            out.append(tok)
        drafts = torch.stack(out, 1).tolist()
        return [drafts[i] if i in active else [] for i in range(len(feed))]

    def settle(self, feed, drafts, keeps, hidden=None) -> None:
        """``hidden`` (B, T, d): the model's last block's output over the fed tokens; the first ``keeps[i]`` rows
        (final-normed) join row i's pending pairs."""
        h = self.model.norm(hidden)
        keeps = [keeps] * h.shape[0] if isinstance(keeps, int) else keeps
        for i, n in enumerate(keeps):
            self.pending[i][0].append(h[i, :n])


class capture_hidden:
    """``with capture_hidden(model, on) as seen:`` - ``seen[-1]`` the output of the model's last block in the
    forwards run inside (the residual stream before the final norm, every position): what ``MTPDrafter``
    reads. Off (``on`` False): nothing is hooked."""

    def __init__(self, model, on: bool = True):
        self.model, self.on, self.seen, self.hook = model, on, [], None

    def __enter__(self):
        if self.on:
            self.hook = self.model.blocks[-1].register_forward_hook(lambda m, a, out: self.seen.append(out[0]))
        return self.seen

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook.remove()


def check_speculative(speculative, model) -> None:
    """ValueError naming ``speculative`` unless it is None, a name of ``SPECULATIVE`` or a draft model for
    ``model``: one with ``prefill`` and ``step``, the same vocabulary size, on the same device."""
    if speculative == "mtp" and getattr(model, "mtp", None) is None:
        raise ValueError("speculative='mtp' needs the checkpoint's multi-token-prediction head (model.mtp: loaded "
                         "from a Qwen3-Next, Qwen3.5, Nemotron-H or Ling 3 folder that holds one); this model has "
                         "none")
    if speculative is None or (isinstance(speculative, str) and speculative in SPECULATIVE):
        return
    if isinstance(speculative, str) or not (callable(getattr(speculative, "prefill", None))
                                            and callable(getattr(speculative, "step", None))):
        raise ValueError(f"speculative must be None, one of {SPECULATIVE} or a draft model (a LanguageModel), "
                         f"got {speculative!r}")
    dv, tv = speculative.config.vocab_size, model.config.vocab_size
    if dv != tv:
        raise ValueError(f"the draft model's vocab_size ({dv}) must equal the model's ({tv}): it drafts token "
                         "ids for it (use a draft with the same tokenizer)")
    dev, tdev = speculative.embed.weight.device, model.embed.weight.device
    if dev != tdev:
        raise ValueError(f"the draft model is on {dev}, the model on {tdev}: put them on one device")


def drafter(speculative, model, prompts, max_ngram: int = MAX_NGRAM, hidden=None, cu_seqlens=None):
    """The drafter ``generate(speculative=...)`` names: "ngram", "mtp" (``hidden``: the prompts' last block
    output, packed by ``cu_seqlens`` or not) or a draft model (checked)."""
    check_speculative(speculative, model)
    if speculative == "ngram":
        return NgramDrafter(prompts, max_ngram)
    if speculative == "mtp":
        return MTPDrafter(model, prompts, hidden, cu_seqlens)
    return ModelDrafter(speculative, model, prompts)


def accept_drafts(logits, drafts, probs=None, generator=None):
    """The acceptance rule over one verification: logits (B, k + 1, vocab), drafts (B, k) -> (tokens (B, k + 1),
    accepted (B,)): row b emits tokens[b, :accepted[b] + 1] - its accepted drafts, then the token drawn at the
    first rejection (or the bonus token after all k). ``probs`` (B, k + 1, vocab): the distributions to sample
    from (``models.sampling.Sampler.probabilities``: the plain loop's, each position's logits processed with
    the drafts before it), each emitted token then distributed as plain sampling draws it (module doc); None:
    greedy, argmax of the logits (processed the same way)."""
    B, T, _ = logits.shape
    k = T - 1
    rows = torch.arange(B, device=logits.device)
    if probs is None:
        best = argmax(logits)                                                     # (B, k + 1)
        return best, (best[:, :k] == drafts).long().cumprod(-1).sum(-1)
    probs = probs / probs.sum(-1, keepdim=True)
    p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)          # (B, k)
    u = torch.rand(B, k, generator=generator, device=logits.device, dtype=probs.dtype)
    accepted = (u < p_draft).long().cumprod(-1).sum(-1)                          # (B,)
    p = probs[rows, accepted]                                                     # (B, vocab) at the first rejection
    if k:
        d = drafts[rows, accepted.clamp(max=k - 1)]
        p = torch.where((accepted < k).unsqueeze(-1), p.scatter(-1, d.unsqueeze(-1), 0.0), p)   # the draft removed
    last = torch.multinomial(p, 1, generator=generator).squeeze(-1)
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
    tokens[rows, accepted] = last
    return tokens, accepted


def draw_in_order(drafts, probs, generator=None):
    """One row's tokens over a verification as plain sampling draws them: drafts (1, k), probs (1, k + 1, vocab)
    (``accept_drafts``' distributions) -> (tokens (1, k + 1), accepted (1,)). Position j draws from its own
    distribution with ``generator``, one ``torch.multinomial`` of one row as a plain step draws, and the row goes
    on past j only while the token drawn is the draft there - so a seed gives the tokens it gives without
    speculation (the server's rule, ``serve.speculation``; with a one-hot draft the standard rule's distribution:
    keep d with probability p(d), else a draw from p without d)."""
    k = drafts.shape[1]
    tokens = torch.cat([drafts, drafts.new_zeros(1, 1)], 1)
    j = 0
    while True:
        tokens[0, j] = torch.multinomial(probs[:, j], 1, generator=generator)[0, 0]
        if j == k or tokens[0, j] != drafts[0, j]:
            return tokens, torch.tensor([j], device=drafts.device)
        j += 1


@dataclass
class SpeculationStats:
    """One ``generate`` call's speculation: ``steps`` model forwards while decoding (``verifications`` of them
    over drafted tokens, the rest plain one-token steps), ``row_steps`` the unfinished rows summed over those
    forwards, ``drafted`` / ``accepted`` drafted tokens and ``emitted`` tokens after the first (all rows)."""
    steps: int = 0
    verifications: int = 0
    row_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row advanced per model forward (1.0: plain decoding's)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance(self) -> float:
        """Accepted drafted tokens over drafted ones."""
        return self.accepted / self.drafted if self.drafted else 0.0
