"""The next token: the sampling options a request may give, checked in one place, and the one logits processing
that ``generate`` and the server (``serve.sampling.RowSampler``) both run.

For each row of (B, vocab) logits, in vLLM's order:

1. ``logit_bias`` (OpenAI): logits[t] += bias[t], a value in [-100, 100] per token id.
2. ``repetition_penalty`` r (HF, vLLM), over the prompt and the generated tokens: the logit of every token
   seen is divided by r where it is > 0 and multiplied by r where it is <= 0.
3. ``frequency_penalty`` f, ``presence_penalty`` p (OpenAI, vLLM), over the generated tokens only:
   logits[t] -= f * count[t] + p * (count[t] > 0).
4. Temperature T: T = 0 (or below ``GREEDY_BELOW``) is greedy, the argmax of what steps 1-3 left; else
5. ``min_p`` (vLLM) drops the tokens whose probability softmax(logits / T) is below min_p x the largest one's,
   ``top_k`` keeps the k largest logits (ties at the k-th kept) - the two commute - and
6. ``top_p`` keeps the nucleus of what is left: the smallest set of most likely tokens whose mass reaches top_p;
7. one token is drawn from softmax(logits / T) over what is left.

Steps 1-3 move the argmax, so they apply to greedy decoding too; steps 5-6 do not. Steps 1-3 are skipped (the
logits untouched, bit for bit) when they ask for nothing. Speculative decoding verifies drafts against the same
distributions: ``Sampler.process_drafts`` processes each verified position with the drafts before it counted,
``Sampler.probabilities`` gives what step 7 would draw from (``models.speculative.accept_drafts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np
import torch

GREEDY_BELOW = 1e-5    # a temperature under this is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow
MAX_BIAS = 100.0       # OpenAI's bound on a logit_bias value


class OptionError(ValueError):
    """A sampling option out of its domain; ``name`` is the argument (the server's 400 names it as the field)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def _real(name, v, low, high, low_open=False) -> float:
    """``v`` as a float in [low, high] (``low_open``: (low, high]); bools, strings, NaN and inf refused by name."""
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) \
            or v < low or v > high or (low_open and v == low):
        rng = f"{'(' if low_open else '['}{low}, {high}]" if high < math.inf else f"{'>' if low_open else '>='} {low}"
        raise OptionError(name, f"{name} must be a finite number {'in ' if high < math.inf else ''}{rng}, got {v!r}")
    return float(v)


def _token_id(name, t) -> int:
    """``t`` as a token id (an int >= 0; bools refused: JSON's true is not 1)."""
    if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
        raise OptionError(name, f"{name}: token ids are ints >= 0, got {t!r}")
    return int(t)


@dataclass
class SamplingOptions:
    """How to pick each next token (module doc) and which tokens end a sequence. Constructing one checks every
    field (``OptionError`` naming it) and normalises: a temperature below ``GREEDY_BELOW`` becomes 0, greedy
    (float32 logits divided by 1e-300 are inf and their softmax NaN; below 1e-5 the distribution is the
    argmax anyway unless two logits tie within ~1e-4); ``min_p`` 0 and ``top_p`` 1 ask for nothing.

    ``stop_ids``: token ids that end a sequence once emitted, besides the model's end-of-text ids, which
    ``ignore_eos`` disregards (the sequence runs to its length). ``logit_bias``: {token id: value}."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    stop_ids: list = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not 0 <= t < math.inf:    # NaN fails both
            raise OptionError("temperature", f"temperature must be a finite number >= 0, got {t!r}")
        self.temperature = 0.0 if t < GREEDY_BELOW else float(t)
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral)
                                       or self.top_k < 1):
            raise OptionError("top_k", f"top_k must be an int >= 1, got {self.top_k!r}")
        if self.top_p is not None:
            self.top_p = _real("top_p", self.top_p, 0, 1, low_open=True)
        if self.min_p is not None:
            self.min_p = _real("min_p", self.min_p, 0, 1)
        for name in ("presence_penalty", "frequency_penalty"):                # OpenAI's range
            setattr(self, name, _real(name, getattr(self, name), -2, 2))
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, 0, math.inf, low_open=True)
        bias = self.logit_bias if self.logit_bias is not None else {}
        if not isinstance(bias, dict):
            raise OptionError("logit_bias", f"logit_bias must map token ids to values, got {type(bias).__name__}")
        self.logit_bias = {_token_id("logit_bias", t): _real("logit_bias", v, -MAX_BIAS, MAX_BIAS)
                           for t, v in bias.items()} or None
        if isinstance(self.stop_ids, (str, bytes)) or not isinstance(self.stop_ids, (list, tuple, set)):
            raise OptionError("stop_ids", f"stop_ids must be a list of token ids, got {self.stop_ids!r}")
        self.stop_ids = [_token_id("stop_ids", t) for t in self.stop_ids]
        if not isinstance(self.ignore_eos, bool):
            raise OptionError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """``OptionError`` for a token id in ``logit_bias`` or ``stop_ids`` that the model's vocabulary lacks."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_ids", self.stop_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise OptionError(name, f"{name}: token id {bad[0]} is not in the vocabulary [0, {vocab_size})")

    def ends(self, eos_ids) -> set[int]:
        """The ids after which a sequence stops: ``stop_ids``, and ``eos_ids`` unless ``ignore_eos``."""
        return set(self.stop_ids) | (set() if self.ignore_eos else set(eos_ids))


def check_sampling(temperature, top_k=None, top_p=None) -> float:
    """The temperature to sample at, after checking all three (``SamplingOptions``' check)."""
    return SamplingOptions(temperature, top_k, top_p).temperature


class Sampler:
    """Draws the next token of each of B rows as ``options`` ask (module doc), counting what it draws for the
    penalties. ``prompts``: each row's prompt ids (the repetition penalty's history starts with them).

        sampler = Sampler(options, [prompt], generator=torch.Generator().manual_seed(seed))
        token = sampler(logits)[0]          # (B, vocab) logits -> (B,) ids, counted as generated
    """

    def __init__(self, options: SamplingOptions, prompts: list[list[int]], generator=None, matchers=None):
        self.options, self.prompts, self.generator = options, prompts, generator
        self.matchers = matchers    # per row a ``models.constrain.RowMatcher`` (or None): its grammar masks the logits
        self._counts = self._seen = self._bias = None     # (B, vocab) float, (B, vocab) bool, (vocab,): built lazily

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 on (B, vocab) logits, in float32 (the input itself when they ask for nothing), then each
        row's grammar (``matchers``): the tokens it does not allow get -inf."""
        if not self._asks() and self.matchers is None:
            return logits
        self._history(logits)
        x = self._apply(logits, self._seen, self._counts)
        if self.matchers is not None:
            x = x.clone() if x is logits else x
            for i, m in enumerate(self.matchers):
                if m is not None and not m.done:
                    x[i].masked_fill_(~m.allowed().to(x.device), float("-inf"))
        return x

    def process_drafts(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 at each verified position of speculative decoding (``models.speculative``): logits
        (B, k + 1, vocab) after the drafts (B, k) -> position i processed with the history plus drafts[:, :i],
        the history it has if those drafts are accepted, so each position is the distribution plain decoding
        would sample there (bit for bit: the same operations on the same counts); then each row's grammar
        (``matchers``) at each position as it stands after the drafts before it (``RowMatcher.along``: up to the
        first draft it refuses or that completes it - the row stops there, so what follows is never read).
        Nothing is recorded."""
        if not self._asks() and self.matchers is None:
            return logits
        self._history(logits[:, 0])
        x = logits
        if self._asks():
            B, T, V = logits.shape
            ahead = torch.zeros(B, T, V, device=logits.device)             # drafts[:, :i] counted at position i
            ahead[:, 1:].scatter_(-1, drafts.unsqueeze(-1), 1.0)
            ahead = ahead.cumsum(1)
            seen = None if self._seen is None else self._seen.unsqueeze(1) | (ahead > 0)
            counts = None if self._counts is None else self._counts.unsqueeze(1) + ahead
            x = self._apply(logits, seen, counts)
        if self.matchers is not None:
            x = x.clone() if x is logits else x                            # as ``process``
            for i, m in enumerate(self.matchers):
                if m is not None and not m.done:
                    masks = m.along(drafts[i].tolist())
                    x[i, :len(masks)].masked_fill_(~torch.stack(masks).to(x.device), float("-inf"))
        return x

    def _asks(self) -> bool:
        o = self.options
        return o.logit_bias is not None or o.repetition_penalty != 1 or bool(o.presence_penalty) \
            or bool(o.frequency_penalty)

    def _apply(self, logits, seen, counts) -> torch.Tensor:
        """Steps 1-3 on logits (..., vocab) given the tokens ``seen`` (bool) and their generated ``counts``."""
        o = self.options
        x = logits.float()
        if self._bias is not None:
            x = x + self._bias
        if seen is not None:
            x = torch.where(seen, torch.where(x > 0, x / o.repetition_penalty, x * o.repetition_penalty), x)
        if counts is not None:
            x = x - o.frequency_penalty * counts - o.presence_penalty * (counts > 0).float()
        return x

    def probabilities(self, x: torch.Tensor) -> torch.Tensor | None:
        """What step 7 draws from, on logits (..., vocab) that steps 1-3 processed: ``probabilities`` at the
        options' temperature, min_p, top_k and top_p; None when greedy (the argmax of x; NaN refused)."""
        o = self.options
        if o.temperature == 0:
            _refuse_nan(x.gather(-1, argmax(x, keepdim=True)))
            return None
        return probabilities(x.flatten(0, -2), o.temperature, o.top_k, o.top_p, o.min_p).view(x.shape)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, vocab) logits -> the (B,) next ids (steps 1-7); they join the penalties' counts."""
        o = self.options
        ids = _draw(self.process(logits), o.temperature, o.top_k, o.top_p, o.min_p, self.generator)
        self.record(ids)
        return ids

    def record(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Count generated tokens: ``ids[j]`` in row ``rows[j]`` (default: one per row, in order)."""
        rows = torch.arange(len(ids), device=ids.device) if rows is None else rows
        if self.matchers is not None:
            for r, t in zip(rows.tolist(), ids.tolist(), strict=True):
                if self.matchers[r] is not None:
                    self.matchers[r].consume(t)
        if self._counts is not None:
            self._counts.index_put_((rows, ids), torch.ones(len(ids), device=ids.device), accumulate=True)
        if self._seen is not None:
            self._seen[rows, ids] = True

    def _history(self, logits: torch.Tensor) -> None:
        """The tensors the penalties read, sized from the first logits (the vocab is the model's head's)."""
        if self._counts is not None or self._seen is not None or self._bias is not None:
            return
        o, (B, V), dev = self.options, logits.shape, logits.device
        if len(self.prompts) != B:
            raise ValueError(f"Sampler: {len(self.prompts)} prompts for {B} rows of logits")
        if o.logit_bias is not None:
            self._bias = torch.zeros(V, device=dev)
            self._bias[torch.tensor(list(o.logit_bias), device=dev)] = torch.tensor(list(o.logit_bias.values()),
                                                                                      device=dev)
        if o.presence_penalty or o.frequency_penalty:
            self._counts = torch.zeros(B, V, device=dev)
        if o.repetition_penalty != 1:
            self._seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            for i, p in enumerate(self.prompts):
                self._seen[i, torch.tensor(p, dtype=torch.long, device=dev)] = True


def argmax(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.argmax(-1)``: the first of equal maxima, a NaN taken as the largest (so a check of the picks finds a
    row's NaN). A float32 / float64 CPU tensor outside a graph goes through numpy, whose vectorised argmax reads a
    50,280-entry row in ~14 us against torch's ~90 (benchmarks/RESULTS.md): every greedy token of every row."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() >= 1 and x.shape[-1] \
            and not x.requires_grad and not torch.compiler.is_compiling():
        ids = torch.from_numpy(np.asarray(x.detach().resolve_neg().numpy().argmax(-1)))   # 1-D: a 0-d array
        return ids.unsqueeze(-1) if keepdim else ids
    return x.argmax(-1, keepdim=keepdim)


def sample_batch(logits, temperature=1.0, top_k=None, top_p=None, generator=None, min_p=None) -> torch.Tensor:
    """One token id per row of (B, vocab) logits (steps 4-7 of the module doc): greedy at temperature 0, else
    softmax(logits / T) within min_p, top_k and the nucleus of mass top_p. NaN logits (or +inf, or a row all
    -inf) are a ValueError: argmax would pick an arbitrary id and multinomial draw garbage."""
    o = SamplingOptions(temperature, top_k, top_p, min_p)
    return _draw(logits, o.temperature, o.top_k, o.top_p, o.min_p, generator)


def _draw(logits, temperature, top_k, top_p, min_p, generator) -> torch.Tensor:
    """``sample_batch`` on options already checked (``SamplingOptions``)."""
    if temperature == 0:
        ids = argmax(logits)                        # argmax picks a row's NaN: checking the B picks checks the rows
        _refuse_nan(logits.gather(-1, ids.unsqueeze(-1)))
        return ids
    probs = probabilities(logits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Steps 4-6 at a temperature > 0: (B, vocab) logits -> the (B, vocab) probabilities ``sample_batch`` draws
    from (unnormalised after top_p; ``torch.multinomial`` normalises). Speculative decoding's acceptance rule
    (``models.speculative.accept_drafts``) reads the same ones; NaN refused."""
    logits = logits.float() / temperature
    if min_p:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p is not None and top_p < 1:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p                   # mass before each token is below top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    _refuse_nan(probs)                                      # NaN logits give NaN probabilities
    return probs


def _refuse_nan(x: torch.Tensor):
    """ValueError if ``x`` (logits or probabilities) holds NaN: the model's output is not a number."""
    if torch.isnan(x).any():
        raise ValueError("logits: the model's output holds NaN (weights with NaN, or an overflow in low "
                         "precision?); there is no distribution to sample from")


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> int:
    """One token id from a (vocab,) logit vector (``sample_batch`` on one row)."""
    return int(sample_batch(logits.unsqueeze(0), temperature, top_k, top_p, generator)[0])
