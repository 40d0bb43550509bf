"""What the fused decoding steps' layer tests share: a model's kernel steps against the same model's PyTorch
steps (``SUBQUAD_KERNELS=0``) and a float64 copy's, the kernel's calls counted."""

from __future__ import annotations

import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.decode import decode_layout


def models(**config):
    """(float32 model laid out for decoding, its float64 copy) of ``ModelConfig(vocab_size=300, mlp=False,
    **config)`` (``config`` may set mlp), seeded."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": 300, "mlp": False, **config})
    m = LanguageModel(cfg).eval()
    m64 = LanguageModel(cfg).eval().double()
    m64.load_state_dict(m.state_dict())
    return decode_layout(m), m64


def assert_steps_agree(monkeypatch, module, m, m64, steps: int, prompt: int = 9, fn: str = "_run") -> int:
    """``steps`` greedy decoding steps of a batch of 3 after a ``prompt``-token prefill: the kernel's logits within
    1e-5 of the logits' scale of the PyTorch step's and of the float64 model's; returns how often ``module``'s
    kernel ran (its function ``fn``)."""
    ids = torch.randint(0, 300, (3, prompt), generator=torch.Generator().manual_seed(1))
    calls = []
    run = getattr(module, fn)
    monkeypatch.setattr(module, fn, lambda *a: calls.append(1) or run(*a))
    with torch.no_grad():
        _, st = m.prefill(ids)
        _, st64 = m64.prefill(ids)
        st_ref = st
        tok = torch.tensor([4, 100, 299])
        for _ in range(steps):
            monkeypatch.setenv("SUBQUAD_KERNELS", "1")
            a, st = m.step(tok, st)
            monkeypatch.setenv("SUBQUAD_KERNELS", "0")
            b, st_ref = m.step(tok, st_ref)
            c, st64 = m64.step(tok, st64)
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
            assert (a.double() - c).abs().max() <= 1e-5 * c.abs().max()
            tok = c.argmax(-1)
    monkeypatch.setenv("SUBQUAD_KERNELS", "1")
    return len(calls)
