"""What the fused decoding steps' layer tests share: a model's kernel steps against the same model's PyTorch
steps (``SUBQUAD_KERNELS=0``) and a float64 copy's, the kernel's calls counted."""

from __future__ import annotations

import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.decode import decode_layout


def count_calls(monkeypatch, cls) -> list:
    """A list that grows by one at each call of ``cls`` (a kept step's class) while the test runs."""
    calls = []
    run = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    return calls


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


def assert_quantized_block_agrees(monkeypatch, module, mixer_cls, pattern: str, kind: str, tol: float,
                                  **options) -> int:
    """A model of ``pattern`` blocks without MLPs whose in_proj, out_proj and head are ``kind`` ("int8": per channel;
    "int4": groups of 32; "int8 blocks": in_proj, out_proj and Mamba's x_proj per block of 32 as a GGUF file's Q8_0,
    x rounded per block as for "int8"; "int8 blocks of 16": per block of 16 as Q6_K's, x exact: within 1e-5 of the
    modules; "q4_0": 4-bit codes per block of 32 as a Q4_0 file packs them, x rounded; "bf16": bfloat16 weights,
    x rounded to bfloat16, where the CPU has the kernel; "f16": float16 weights, x exact, as a GGUF file's F16
    matrices load: within 1e-5 of the modules), else the small x_proj /
    dt_proj float32 as at mamba-130m's shape, decoding 1 and the most rows the block kernel takes for them
    (``kernels.qgemv.block_int8q_rows()`` or ``AMX_ROWS``, ``INT4_ROWS``, ``INT8_ROWS``), and 3: the block kernel's
    logits within 1% of the logits' scale of the same model's steps through its modules (the same products one call
    each: ``mixer_cls.fused_block`` refused, INT8Q_ROWS raised to the block's; not 1e-5 as in float32: x rounded to int8
    per block of 32 is a step function, and the two paths' norms differ in the last bit, so now and then one code of
    x differs by one - 3.5e-3 of the scale here) and within ``tol`` of a float64 copy's with the dequantised
    weights; one row more runs the modules. Returns how often a ``module.BlockStep`` ran."""
    from subquad.kernels import qgemv
    from subquad.models.quant import Int8Linear, quantize

    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=300, d_model=64, n_layers=2, pattern=pattern, mlp=False,
                                  mixer_options=options)).eval()
    exact = kind in ("int8 blocks of 16", "f16")
    if kind.startswith("int8 blocks") or kind == "q4_0":   # a GGUF file's: scales per block of 32 (Q8_0, Q4_0), 16
        from subquad.models.quant import pack_q4_0

        size, top = (16 if exact else 32), (7 if kind == "q4_0" else 127)
        for blk in m.blocks:
            for name in ("in_proj", "out_proj") + (("x_proj",) if pattern == "mamba" else ()):
                w = getattr(blk.mixer, name).weight.detach()
                s = (w.view(w.shape[0], -1, size).abs().amax(-1) / top).clamp_min(1e-12)
                q = torch.round(w.view(w.shape[0], -1, size) / s[..., None]).to(torch.int8).view_as(w)
                q = pack_q4_0(q) if kind == "q4_0" else q
                setattr(blk.mixer, name, Int8Linear.from_blocks(q.contiguous(), s.contiguous()))
    elif kind == "f16":                                 # what gguf.load._keep_half makes of an F16 file's matrices
        from subquad.models.quant import F16Linear

        for blk in m.blocks:
            for name in ("in_proj", "out_proj"):
                setattr(blk.mixer, name, F16Linear(getattr(blk.mixer, name).weight))
    else:
        quantize(m, kind, min_weights=8192, group_size=32)
    assert type(m.blocks[0].mixer.in_proj).__name__ == {"int4": "Int4Linear", "bf16": "Bf16Linear",
                                                        "f16": "F16Linear"}.get(kind, "Int8Linear")
    m64 = LanguageModel(m.config).eval().double()
    m64.load_state_dict({k: v for k, v in m.state_dict().items() if k in m64.state_dict()}, strict=False)
    for name, mod in m.named_modules():                 # the dequantised weights into the float64 copy
        if type(mod).__name__ in ("Int8Linear", "Int4Linear", "Bf16Linear", "F16Linear") and name != "head":
            m64.get_submodule(name).weight.data.copy_(mod.weight)
    monkeypatch.setattr(qgemv, "INT8Q_ROWS", qgemv.block_int8q_rows())   # the modules' products the block's too
    calls = []
    real = module.BlockStep.__call__
    monkeypatch.setattr(module.BlockStep, "__call__", lambda *a: calls.append(1) or real(*a))
    own = mixer_cls.fused_block
    most = {"int8": qgemv.AMX_ROWS if qgemv.packed_int8() else qgemv.block_int8q_rows(), "int4": qgemv.INT4_ROWS,
            "int8 blocks of 16": qgemv.INT8_ROWS, "bf16": qgemv.BF16_ROWS, "f16": qgemv.F16_ROWS}.get(kind,
                                                                                          qgemv.ROUNDED_ROWS)
    for rows in (1, 3, most):                           # int8 with AMX tiles: 3 rows int8q, 16 the tiles; bf16: 1
        # row its vectors, 3 and 16 its tiles where the CPU has them; Q8_0's, Q4_0's: x rounded
        ids = torch.randint(0, 300, (rows, 7), generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            _, st = m.prefill(ids)
            _, st64 = m64.prefill(ids)
            st_ref, tok = st, ids[:, -1]
            for _ in range(3):
                a, st = m.step(tok, st)
                monkeypatch.setattr(mixer_cls, "fused_block", lambda *a: None)
                b, st_ref = m.step(tok, st_ref)
                monkeypatch.setattr(mixer_cls, "fused_block", own)
                c, st64 = m64.step(tok, st64)
                assert (a - b).abs().max() <= (1e-5 if exact else 1e-2) * b.abs().max()
                assert (a.double() - c).abs().max() <= tol * c.abs().max()
                tok = c.argmax(-1)
    n = len(calls)
    more = rows + 1                                     # past the kernel's rows: the modules' library products
    with torch.no_grad():
        m.step(torch.arange(more), m.prefill(torch.randint(0, 300, (more, 3)))[1])
    assert len(calls) == n
    return n


def step_logits(m, ids, tok):
    """The logits of one decoding step of ``tok`` after prefilling ``ids``, without gradients."""
    with torch.no_grad():
        _, st = m.prefill(ids)
        return m.step(tok, st)[0]
