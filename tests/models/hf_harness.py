"""One harness for every Hugging Face checkpoint type, as ``tests/ops/harness.py`` is for the ops.

A type is a ``Row`` of ``tests/models/test_hf_parity.py``: how to build a tiny random transformers model of it
(``build(tmp_path, dtype, **over)`` returning the model and the folder it saved; ``tiny`` is the common
skeleton), and which variants of the skeleton checks it runs - logits equal to transformers' (per dtype, within
a tolerance of their largest), prefill then one-token decoding equal to the full forward, packed rows equal to
separate ones, greedy tokens transformers' own, a ``save_pretrained`` round trip transformers loads, and the
router loss of a mixture of experts. What is the type's alone stays in its ``test_hf_<type>.py``, with
``assert_refused`` for the folders it refuses by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

F32 = (torch.float32, 1e-4)
F64 = (torch.float64, 1e-6)


# ---------------------------------------------------------------------------------------------- building
def tiny(tmp_path, name, Config, Model, cfg, dtype=torch.float32, noisy=(), eager=False, tweak=None):
    """A tiny random ``Model(Config(**cfg))`` in ``dtype`` (seed 0), saved to ``tmp_path / name``: every parameter
    whose name ends with one of ``noisy`` moved by N(0, 0.3) (non-trivial norms, D, dt and biases), then
    ``tweak(model)`` (no gradients) for what is the type's own. ``eager``: the experts' eager implementation (the
    grouped-matmul default has no float64)."""
    torch.manual_seed(0)
    cfg = Config(**cfg)
    if eager:
        cfg._experts_implementation = "eager"
    model = Model(cfg).to(dtype).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(noisy):
                p.add_(torch.randn_like(p) * 0.3)
        if tweak is not None:
            tweak(model)
    folder = tmp_path / name
    model.save_pretrained(folder)
    return model, folder


def buffers_by(suffix, how, model):
    """``how(buffer)`` (in place) for every buffer of ``model`` whose name ends with ``suffix``."""
    for n, b in model.named_buffers():
        if n.endswith(suffix):
            how(b)


def token_ids(V, T=50):
    """The checks' two rows of ``T`` tokens below ``V`` (seed 1)."""
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------- assertions
def assert_prefill_then_decode_equals_forward(ours, ids, split=12):
    """Prefill ``split`` tokens, then decode the rest one at a time: the full forward's logits (1e-10)."""
    with torch.no_grad():
        full = ours(ids)
        logits, state = ours.prefill(ids[:, :split])
        steps = [logits]
        for t in range(split, ids.shape[1]):
            lt, state = ours.prefill(ids[:, t:t + 1], state)
            steps.append(lt)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def assert_logits_equal(ours, hf, ids, dtype, tol, hf_logits=None):
    """Our logits over ``ids`` are in ``dtype`` and equal transformers' within ``tol`` of their largest
    (``hf_logits(hf, ids)``: transformers' logits computed otherwise, which must already be in ``dtype``)."""
    with torch.no_grad():
        if hf_logits is None:
            ref = hf(ids).logits.to(dtype)
        else:
            ref = hf_logits(hf, ids)
            assert ref.dtype == dtype
        got = ours(ids)
    assert got.dtype == dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol


def assert_packed_equals_separate(ours, two):
    """Rows 0 and 1 of ``two`` packed in one row (13 + 20 tokens; positions restart) give each one's logits."""
    with torch.no_grad():
        cu = torch.tensor([0, 13, 33])
        packed = ours(torch.cat([two[0, :13], two[1, :20]]).view(1, -1), cu_seqlens=cu)
        torch.testing.assert_close(packed[0, :13], ours(two[:1, :13])[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(packed[0, 13:], ours(two[1:, :20])[0], rtol=0, atol=1e-10)


def assert_round_trip(hf, ours, Model, folder, ids, model_type, atol=1e-5, ours_atol=0.0, save_as=None):
    """``save_pretrained(ours)`` (as ``save_as``, its own type by default) is a ``model_type`` folder that
    transformers' ``Model`` loads with hf's logits (``atol``) and that subquad loads back with its logits
    (``ours_atol``)."""
    from subquad.models.hf import from_pretrained, save_pretrained

    save_pretrained(ours, folder, **({} if save_as is None else {"model_type": save_as}))
    again = Model.from_pretrained(folder, experts_implementation="eager").eval()
    assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
    ours2, _ = from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=atol)
        torch.testing.assert_close(ours2(ids), ours(ids), rtol=0, atol=ours_atol)


def greedy_agreement(ours, hf, ids, hf_logits, n=32):
    """Our n greedy tokens after ``ids`` (1, T): each must be transformers' greedy choice under its own
    forward (``hf_logits``); returns how many equal its ``generate`` before that leaves its own forward."""
    T = ids.shape[1]
    want = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, T:].tolist()
    got, _ = ours.generate(ids[0].tolist(), n, temperature=0)
    with torch.no_grad():
        hl = hf_logits(torch.tensor([ids[0].tolist() + got]))[0, T - 1:-1]
    agree = 0
    for t, token in enumerate(got):
        assert hl[t, token] >= hl[t].max() - 1e-6 * hl[t].abs().max(), f"step {t}: not transformers' greedy token"
        if want[t] != token:       # transformers' cached decoding left its own forward, not us
            assert hl[t, want[t]] < hl[t].max(), f"step {t}: transformers' generate and forward agree, we do not"
            break
        agree += 1
    return agree


# ---------------------------------------------------------------------------------------------- the table's rows
def variants(dtypes=(F32, F64), **overs):
    """Logits cases: every named ``over`` (none given: one, ``{}``) in every (dtype, tol) of ``dtypes``."""
    overs = overs or {"": {}}
    return tuple((f"{name}-{str(d).removeprefix('torch.')}".lstrip("-"), over, d, tol)
                 for name, over in overs.items() for d, tol in dtypes)


@dataclass(frozen=True)
class Row:
    """One checkpoint type, or one configuration of it, and the skeleton checks it runs.

    ``logits``: (id, over, dtype, tol) cases (``variants``); ``loaded(ours, over)``: the type's assertions on
    the model loaded for one. ``decode``: the prefill/decode, packed and greedy check runs (on a model built in
    ``decode_dtype``, cast to float64 with ours) and at least ``min_agree`` of the 32 greedy tokens equal
    transformers' ``generate``. ``round_trip``: (id, over) cases saved as ``save_as`` and loaded back by
    ``Model`` as ``model_type`` (``atol`` from hf's logits, ``ours_atol`` from ours); ``saved(hf, ours,
    config, over, folder)``: the type's assertions on the folder written. ``router_loss``: the mixture of experts'
    load-balancing loss (float64) equals transformers' (1e-6 of it). ``hf_logits(hf, ids)``: transformers' logits
    where its ``forward(ids).logits`` is not what to compare with.
    """

    id: str
    build: Callable[..., Any]
    V: int
    Model: Any = None
    T: int = 50
    logits: tuple = variants()
    loaded: Callable | None = None
    decode: bool = True
    decode_dtype: torch.dtype = torch.float64
    min_agree: int = 32
    hf_logits: Callable | None = None
    round_trip: tuple = (("", {}),)
    model_type: str | None = None
    save_as: str | None = None
    atol: float = 1e-5
    ours_atol: float = 0.0
    saved: Callable | None = None
    router_loss: bool = False
    marks: tuple = field(default=())

    def ids(self):
        return token_ids(self.V, self.T)


def cases(rows, what):
    """pytest params (row, case) over the rows' ``what`` cases, named ``type[-case]``."""
    out = []
    for row in rows:
        for case in getattr(row, what):
            out.append(pytest.param(row, case, id="-".join(s for s in (row.id, case[0]) if s), marks=row.marks))
    return out


def check_logits(row, case, tmp_path):
    from subquad.models.hf import from_pretrained

    _, over, dtype, tol = case
    hf, folder = row.build(tmp_path, dtype, **over)
    ours, tok = from_pretrained(folder, dtype=dtype)
    assert tok is None
    if row.loaded is not None:
        row.loaded(ours, over)
    assert_logits_equal(ours, hf, row.ids(), dtype, tol, row.hf_logits)


def check_decode(row, tmp_path):
    from subquad.models.hf import from_pretrained

    hf, folder = row.build(tmp_path, row.decode_dtype)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    if row.decode_dtype != torch.float64:
        hf = hf.double()
    ids = row.ids()[:1, :20]
    assert_prefill_then_decode_equals_forward(ours, ids)
    assert_packed_equals_separate(ours, row.ids())
    forward = (lambda x: hf(x).logits) if row.hf_logits is None else (lambda x: row.hf_logits(hf, x))
    assert greedy_agreement(ours, hf, ids, forward) >= row.min_agree


def check_round_trip(row, case, tmp_path):
    from subquad.models.hf import from_pretrained

    _, over = case
    hf, folder = row.build(tmp_path, **over)
    ours, _ = from_pretrained(folder)
    back = tmp_path / "back"
    assert_round_trip(hf, ours, row.Model, back, row.ids(), row.model_type or row.id, row.atol, row.ours_atol,
                      row.save_as)
    if row.saved is not None:
        row.saved(hf, ours, json.loads((back / "config.json").read_text()), over, back)


def check_router_loss(row, tmp_path):
    from subquad.models.hf import from_pretrained

    hf, folder = row.build(tmp_path, torch.float64)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        want = hf(row.ids(), output_router_logits=True).aux_loss
        ours(row.ids())
    torch.testing.assert_close(ours.aux_loss(), want.to(torch.float64), rtol=1e-6, atol=0)


def assert_refused(folder, match, config=None, weights=None):
    """With ``config`` (a dict) as its config.json and ``weights`` as its model.safetensors, where given,
    ``from_pretrained(folder)`` raises a ValueError that matches ``match``."""
    from subquad.models.hf import from_pretrained

    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        from safetensors.torch import save_file

        save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        from_pretrained(folder)
