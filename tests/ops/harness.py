"""One harness for every op: three-form agreement, split sequences, gradients.

An op is described by ``call(mode, inputs, chunk_size, initial_state, output_final_state)``
returning (o, state), and ``make(B, T, seed)`` returning a dict of float64 inputs
(requires_grad set). States are flattened to a list of tensors to compare.
"""

from __future__ import annotations

import torch

MODES = ("parallel", "recurrent", "chunk")


def flat(state):
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    if hasattr(state, "k") and hasattr(state, "v"):
        return [state.k, state.v]
    return [t for s in state for t in flat(s)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    if b.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_close(a, b, tol, what="", atol=None):
    """Element-wise, as torch.testing.assert_close: |a - b| <= atol + tol |b| for every entry (atol = tol by
    default), so an error in a small entry is not hidden by the largest one."""
    assert a.shape == b.shape, f"{what}: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    atol = tol if atol is None else atol
    bad = (a - b).abs() > atol + tol * b.abs()
    if bad.any():
        i = bad.flatten().nonzero()[0].item()
        raise AssertionError(f"{what}: {int(bad.sum())} of {b.numel()} entries differ by more than {atol:.1e} + "
                             f"{tol:.1e} |b|; first at flat index {i}: {a.flatten()[i].item():.6g} vs "
                             f"{b.flatten()[i].item():.6g} (largest relative-to-max error {rel_err(a, b):.3e})")


def check_forms_agree(call, inputs, chunk_size, initial_state=None, tol=1e-10, modes=MODES, ref="parallel"):
    """Every form's output and final state equal the reference form's."""
    o_ref, s_ref = call(ref, inputs, chunk_size, initial_state, True)
    for m in modes:
        if m == ref:
            continue
        o, s = call(m, inputs, chunk_size, initial_state, True)
        assert o.shape == o_ref.shape
        assert_close(o, o_ref, tol, f"{m} vs {ref}: o")
        for a, b in zip(flat(s), flat(s_ref), strict=True):
            assert_close(a, b, tol, f"{m} vs {ref}: final state")


def check_split(call, inputs, split, chunk_size, mode, seq_keys, tol=1e-10):
    """Running tokens [0, split) then [split, T) from the first call's state equals one call."""
    o_full, s_full = call(mode, inputs, chunk_size, None, True)
    first = {n: (x[:, :split] if n in seq_keys else x) for n, x in inputs.items()}
    second = {n: (x[:, split:] if n in seq_keys else x) for n, x in inputs.items()}
    o1, s1 = call(mode, first, chunk_size, None, True)
    o2, s2 = call(mode, second, chunk_size, s1, True)
    assert_close(torch.cat([o1, o2], 1), o_full, tol, f"{mode} split at {split}: o")
    for a, b in zip(flat(s2), flat(s_full), strict=True):
        assert_close(a, b, tol, f"{mode} split at {split}: final state")


def grads(call, mode, inputs, chunk_size, initial_state, do, dstate):
    """Gradients of <o, do> + <final_state, dstate> w.r.t. every input and the initial state."""
    o, s = call(mode, inputs, chunk_size, initial_state, True)
    loss = (o * do).sum() + sum((a * b).sum() for a, b in zip(flat(s), dstate))
    wrt = [x for x in inputs.values() if x.requires_grad] + [x for x in flat(initial_state) if x.requires_grad]
    return torch.autograd.grad(loss, wrt)


def check_grads_agree(call, inputs, chunk_size, initial_state, tol=1e-10, modes=MODES, ref="parallel", seed=0):
    g = torch.Generator().manual_seed(seed)
    o, s = call(ref, inputs, chunk_size, initial_state, True)
    do = torch.randn(o.shape, generator=g, dtype=o.dtype)
    dstate = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in flat(s)]
    g_ref = grads(call, ref, inputs, chunk_size, initial_state, do, dstate)
    names = [n for n, x in inputs.items() if x.requires_grad] + ["initial_state"] * len(flat(initial_state))
    for m in modes:
        if m == ref:
            continue
        for name, a, b in zip(names, grads(call, m, inputs, chunk_size, initial_state, do, dstate), g_ref, strict=True):
            assert_close(a, b, tol, f"{m} vs {ref}: d{name}")


def count_calls(monkeypatch, kernel) -> list:
    """A list that grows by one at each call of the C ``kernel`` (a ``subquad.kernels.Kernel``; every other
    kernel runs uncounted)."""
    calls = []
    run = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__",
                        lambda self, *a: (calls.append(1) if self is kernel else None) or run(self, *a))
    return calls
