"""Serving: an engine with continuous batching and prefix-state reuse (usable without HTTP), and an
OpenAI-compatible HTTP server on top of it (``subquad serve``; the ``serve`` extra: FastAPI, uvicorn).

    from subquad.serve import Engine, SamplingParams
"""

from subquad.serve.engine import Engine, Event, NotAccepting, QueueFull, Sequence
from subquad.serve.prefix_cache import PrefixCache
from subquad.serve.sampling import SamplingParams

__all__ = ["Engine", "Event", "NotAccepting", "QueueFull", "Sequence", "PrefixCache", "SamplingParams"]
