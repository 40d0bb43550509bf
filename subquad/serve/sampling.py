"""A request's sampling parameters, checked, and its per-row sampler.

Each row of the server's batch samples with its own ``torch.Generator`` so that its tokens equal the
request run alone through ``LanguageModel.generate``: ``generate`` draws one sequence's tokens with a
``models.sampling.Sampler`` on (1, vocab) rows from a generator seeded with ``seed``; ``RowSampler`` is that
sampler, one row at a time, whichever other rows share the step. Choice i of a request with ``n`` choices
draws from ``seed + i``: choice 0 is the request run alone, choice i the request run alone with ``seed + i``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from subquad.models.constrain import FormatError, check_format
from subquad.models.sampling import GREEDY_BELOW, OptionError, Sampler, SamplingOptions  # noqa: F401 (re-exported)

MAX_LOGPROBS = 20      # OpenAI's bound on chat's ``top_logprobs`` (completions' ``logprobs``: 5, in protocol)
MAX_SEED = 2 ** 63


@dataclass
class SamplingParams(SamplingOptions):
    """What one request asks of the engine: ``SamplingOptions`` (temperature, top_k, top_p, min_p, penalties,
    logit_bias, stop_ids, ignore_eos: checked there, the check ``generate`` uses) and ``max_tokens``, ``seed``,
    ``stop`` (strings that end the text when they appear in it, matched on the decoded text across token
    boundaries, not included in the output), ``logprobs`` (None, or how many most likely alternatives to report
    beside each token's own log-probability, 0..20), ``n`` (choices: the prompt prefilled once, its state
    copied per choice; choice i seeded ``seed + i``) and ``response_format`` (OpenAI's: text, json_object or
    json_schema, ``models.constrain``). Bad values raise ``OptionError`` naming the field."""

    max_tokens: int = 16
    seed: int | None = None
    stop: list = field(default_factory=list)
    logprobs: int | None = None
    n: int = 1
    response_format: dict | None = None

    def __post_init__(self):
        super().__post_init__()
        for name, low in (("max_tokens", 1), ("n", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise OptionError(name, f"{name} must be an int >= {low}, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -MAX_SEED <= self.seed < MAX_SEED):
            raise OptionError("seed", f"seed must be an int in [-2**63, 2**63) (OpenAI's int64), got {self.seed!r}")
        if self.seed is not None and self.seed + self.n > MAX_SEED:
            raise OptionError("seed", f"seed + n must stay below 2**63 (choice i draws from seed + i), got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > 4 or \
                any(not isinstance(s, str) or not s for s in self.stop):
            raise OptionError("stop", f"stop must be a non-empty string or a list of up to 4, got {self.stop!r}")
        self.stop = list(self.stop)
        try:
            check_format(self.response_format)
        except FormatError as e:
            raise OptionError("response_format", str(e)) from None
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise OptionError("logprobs", f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


class RowSampler:
    """Draws one row's tokens as ``generate`` draws a lone sequence's: a ``Sampler`` over (1, vocab) rows whose
    history is ``prompt``, with a generator seeded ``seed + index`` (choice ``index`` of the request; an
    unseeded request gets a generator of its own, randomly seeded, so no request's draws depend on another's)."""

    def __init__(self, params: SamplingParams, device, prompt: list[int], index: int = 0, matcher=None):
        seed = params.seed + index if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.matcher = matcher                  # the row's grammar (``models.constrain.RowMatcher``) or None
        self.sampler = Sampler(params, [prompt], self.generator, None if matcher is None else [matcher])

    def __call__(self, row: torch.Tensor) -> int:
        """row: (1, vocab) logits -> the token id."""
        return int(self.sampler(row)[0])


def logprobs_of(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the model's distribution (log-softmax of the raw (1, vocab)
    logits, before temperature, penalties, bias and truncation, as vLLM's default) and the ``top`` most likely
    (id, log-probability) pairs."""
    lp = torch.log_softmax(row[0].float(), -1)
    pairs = []
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        pairs = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), pairs
