"""Each op's three forms as public functions: ``parallel_gla(...) == gla(..., mode="parallel")``.

Softmax and linear attention define their per-form functions by hand (each form has its own
file with its own argument handling); the other ops get theirs here, from the op itself, so every
family exposes ``parallel_<op>``, ``recurrent_<op>`` and ``chunk_<op>`` with the op's signature
less ``mode`` - and the op's checks, precision rules and non-finite guard.
"""

from __future__ import annotations

import functools
import inspect


def fixed_mode(op, mode: str):
    """``op`` with ``mode`` fixed, named ``<mode>_<op name>``."""
    name = f"{mode}_{op.__name__}"

    @functools.wraps(op)
    def form(*args, **kwargs):
        if "mode" in kwargs:
            raise TypeError(f"{name}() fixes mode={mode!r}; call {op.__name__}() to choose it")
        return op(*args, mode=mode, **kwargs)

    sig = inspect.signature(op)
    form.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "mode"])
    form.__name__ = form.__qualname__ = name
    form.__doc__ = f"``{op.__name__}`` in its {mode} form (``mode={mode!r}``).\n\n{op.__doc__ or ''}"
    del form.__wrapped__
    return form


def three_forms(op) -> tuple:
    """(parallel_<op>, recurrent_<op>, chunk_<op>)."""
    return tuple(fixed_mode(op, m) for m in ("parallel", "recurrent", "chunk"))
