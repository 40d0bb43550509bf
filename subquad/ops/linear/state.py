"""The linear-attention state: S (B, H, K, V), plus z (B, H, K) when normalised."""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_state


def unpack_state(initial_state, q: torch.Tensor, v: torch.Tensor, normalize: bool):
    """Validate ``initial_state`` and return ``(S0, z0)`` (None when absent), in the state's dtype
    (``checks.check_state``: another dtype is refused, not cast).

    Normalised attention carries ``(S, z)``; unnormalised carries ``S`` alone.
    """
    B, _, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        return None, None
    if normalize:
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise ValueError(
                "initial_state must be a pair (S (B, H, K, V), z (B, H, K)) when normalize=True, "
                f"got {type(initial_state).__name__}"
            )
        S0, z0 = initial_state
        check_state("initial_state[0] (S)", S0, (B, H, K, V), q)
        check_state("initial_state[1] (z)", z0, (B, H, K), q)
        return S0, z0
    check_state("initial_state", initial_state, (B, H, K, V), q)
    return initial_state, None


def pack_state(S: torch.Tensor, z, normalize: bool):
    return (S, z) if normalize else S
