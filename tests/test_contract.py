"""The contract of DESIGN.md ("The op contract", "Layers and models"), read from the code itself:
a public op, form or layer whose signature drifts from it fails here."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import subquad
import subquad.ops as ops
from subquad.layers.base import Mixer
from subquad.layers.registry import MIXERS

ATTENTION_INPUTS = {                      # the positional inputs of each op, gates after the values
    "linear_attention": ["q", "k", "v"],
    "retention": ["q", "k", "v", "g"],
    "simple_gla": ["q", "k", "v", "g"],
    "gla": ["q", "k", "v", "g"],
    "delta_rule": ["q", "k", "v", "beta"],
    "gated_delta_rule": ["q", "k", "v", "g", "beta"],
    "softmax_attention": ["q", "k", "v"],
    "ssd": ["x", "dt", "A", "B", "C"],
    "selective_scan": ["x", "dt", "A", "B", "C"],
}
CONTRACT = {"mode": "chunk", "chunk_size": 64, "initial_state": None, "output_final_state": False,
            "cu_seqlens": None}


def test_every_op_is_listed():
    assert set(ops.OPS) == set(ATTENTION_INPUTS)


@pytest.mark.parametrize("name", ops.OPS)
def test_op_signature(name):
    sig = inspect.signature(getattr(ops, name))
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ATTENTION_INPUTS[name]
    kw = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    for key, default in CONTRACT.items():
        assert key in kw and kw[key] == default, (name, key)
    if positional[0] == "q":                                  # scans have no query scale
        assert kw.get("scale", "missing") is None, name


@pytest.mark.parametrize("name", ops.OPS)
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_forms_are_public_and_share_the_signature(name, mode):
    op, form = getattr(ops, name), getattr(ops, f"{mode}_{name}")
    a = {k: v for k, v in inspect.signature(op).parameters.items() if k != "mode"}
    b = dict(inspect.signature(form).parameters)
    assert list(a) == list(b[k].name for k in b if k in a)     # same names, same order
    assert all(a[k].default == b[k].default for k in a if k in b), (name, mode)
    assert "mode" not in b


def _tiny(name):
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 5, 2, 4
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)      # noqa: E731
    q, k, v = r(B, T, H, K), torch.nn.functional.normalize(r(B, T, H, K), dim=-1), r(B, T, H, K)
    gates = {"g": -torch.rand(B, T, H, generator=g, dtype=torch.float64), "beta": torch.rand(B, T, H, generator=g,
                                                                                              dtype=torch.float64)}
    if name == "retention":
        gates["g"] = torch.full((H,), -0.1, dtype=torch.float64)
    if name == "gla":
        gates["g"] = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64)
    if name in ("ssd", "selective_scan"):
        Dm = H * K if name == "selective_scan" else None
        x = r(B, T, Dm) if Dm else r(B, T, H, K)
        dt = torch.rand(*(x.shape if Dm else (B, T, H)), generator=g, dtype=torch.float64)
        A = -torch.rand(*((Dm, 3) if Dm else (H,)), generator=g, dtype=torch.float64)
        return [x, dt, A, r(B, T, 3), r(B, T, 3)]
    return [q, k, v] + [gates[n] for n in ATTENTION_INPUTS[name][3:]]


@pytest.mark.parametrize("name", ops.OPS)
def test_op_returns_output_and_state_only_when_asked(name):
    args = _tiny(name)
    o, s = getattr(ops, name)(*args)
    assert s is None and o.shape[:2] == args[0].shape[:2]
    o2, s2 = getattr(ops, name)(*args, output_final_state=True)
    assert s2 is not None and torch.equal(o, o2)


def test_no_function_shadows_its_package():
    for info in pkgutil.iter_modules(ops.__path__):
        mod = importlib.import_module(f"subquad.ops.{info.name}")
        assert getattr(ops, info.name, mod) is mod, f"subquad.ops.{info.name} is shadowed"
        if info.ispkg and info.name != "common":
            assert (Path(mod.__file__).parent / "README.md").exists(), f"ops/{info.name} has no README.md"


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_layer_contract(name):
    cls = MIXERS[name].cls
    assert issubclass(cls, Mixer)
    assert cls.forward is Mixer.forward, "layers write mix(); the shared preamble stays in Mixer.forward"
    init = inspect.signature(cls.__init__).parameters
    assert not {"headdim", "d_conv", "kernel_size"} & set(init), "one name each: head_dim, conv_size"
    assert list(inspect.signature(cls.mix).parameters) == ["self", "x", "state", "seq"]
    es = inspect.signature(cls.empty_state).parameters
    assert list(es) == ["self", "batch_size", "device", "dtype"]
    assert es["device"].default is None and es["dtype"].default is torch.float32


def test_layers_and_models_do_not_import_the_distributed_package():
    root = Path(subquad.__file__).parent
    for folder in ("layers", "models"):
        for f in (root / folder).glob("*.py"):
            names = [n.module or "" for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)]
            names += [a.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Import) for a in n.names]
            assert not any(n.startswith("subquad.distributed") for n in names), f"{folder}/{f.name} imports it"


def test_top_level_exports():
    for name in ("ops", "layers", "models", "build_mixer", "ModelConfig", "LanguageModel", "preset"):
        assert hasattr(subquad, name)
