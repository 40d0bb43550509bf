"""How a recurrent op's final state depends on the state it starts from: its state-passing transition.

Every recurrent op here is affine in its initial state. For a call over a piece of the sequence,

    S_out = M S_in + S_0        S_0: the final state from a zero state

and zeroing the op's *value* input (``values``: v, or Mamba's x) leaves only the transition M S_in.
So the op itself yields M, with no per-op code:

    identity  M = I                                   (linear attention: the state only adds)
    diagonal  M = op(values=0, initial_state=1)       elementwise decays (retention, GLA, SSD, Mamba), M * S
    matrix    M = op(values=0 of width K, initial_state=I_K)     (K, K) per head (the delta rules), M @ S

``normaliser``: a bool option that makes the op divide by a running normaliser (linear attention's
``normalize``); state passing carries it as an extra value column of ones and divides at the end.

Context parallelism (``subquad.distributed``) reads ``transition_of(op)`` and nothing else about the op,
so a new recurrent op is context-parallel once it declares its transition (``subquad.ops``'s table).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("identity", "diagonal", "matrix")


@dataclass(frozen=True)
class Transition:
    kind: str                       # one of KINDS
    values: str = "v"               # the argument that carries the inputs written into the state
    normaliser: str | None = None   # a bool argument carried as an extra value column (linear attention)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"transition kind must be one of {KINDS}, got {self.kind!r}")


def declare(op, transition: Transition):
    """Attach ``transition`` to ``op`` (a public op function); returns the op."""
    op.transition = transition
    return op


def transition_of(op) -> Transition | None:
    return getattr(op, "transition", None)
