"""A request's sampling parameters, checked, and its per-row sampler.

Each row of the server's batch samples with its own ``torch.Generator`` so that its tokens equal the
request run alone through ``LanguageModel.generate``: ``generate`` draws one sequence's tokens with
``sample_batch`` on a (1, vocab) row from a generator seeded with ``seed``; ``RowSampler`` makes exactly
those calls, one row at a time, whichever other rows share the step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from subquad.models.generate import GREEDY_BELOW, check_sampling, sample_batch  # noqa: F401 (re-exported)

MAX_LOGPROBS = 5       # OpenAI's bound on completions' ``logprobs``


@dataclass
class SamplingParams:
    """What one request asks of the engine. ``stop``: strings that end the text when they appear in it
    (matched on the decoded text, across token boundaries; not included in the output). ``logprobs``: None,
    or how many most likely alternatives to report beside each token's own log-probability (0..5).
    ``temperature``, ``top_p`` and ``top_k`` are checked by ``check_sampling``, the one ``generate`` uses:
    a temperature below ``GREEDY_BELOW`` is set to 0, greedy (float32 logits divided by 1e-300 are inf and
    their softmax NaN)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list = field(default_factory=list)
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self.temperature = check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > 4 or \
                any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of up to 4 of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


class RowSampler:
    """Draws one row's tokens as ``generate`` draws a lone sequence's: ``sample_batch`` on the (1, vocab)
    row with a generator seeded by ``seed`` (an unseeded request gets a generator of its own, randomly
    seeded, so no request's draws depend on another's)."""

    def __init__(self, params: SamplingParams, device):
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.params = params

    def __call__(self, row: torch.Tensor) -> int:
        """row: (1, vocab) logits -> the token id."""
        p = self.params
        return int(sample_batch(row, p.temperature, p.top_k, p.top_p, self.generator)[0])


def logprobs_of(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the model's distribution (log-softmax of the raw (1, vocab)
    logits, before temperature and truncation) and the ``top`` most likely (id, log-probability) pairs."""
    lp = torch.log_softmax(row[0].float(), -1)
    pairs = []
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        pairs = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), pairs
