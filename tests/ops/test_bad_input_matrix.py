"""Every public op x every argument x every class of bad value: refused clearly, never accepted silently.

The matrix is generated: the ops from ``subquad.ops.__all__``, their arguments from their signatures,
and for each argument the classes of issue 32 - wrong rank, wrong dtype, None, a list, mismatched
sizes (or a scalar out of its range), a non-finite scalar, a string for a bool, the meta device.
A bad call must raise ValueError (or TypeError) whose message names the argument. Where a class gives
no bad value for an argument (None where None is allowed, a float64 gate) the call must *succeed*,
and the reason is in ``VALID``; where a class has no value at all it is in ``NOT_APPLICABLE``. A new
op or a new argument fails ``test_every_argument_has_a_kind`` until it is classified here.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import subquad.ops as ops
from tests.ops.tiny import FAMILY, T, inputs

CLASSES = ("rank", "dtype", "none", "list", "size", "nonfinite", "str_for_bool", "meta")

# what each keyword argument is; every positional argument is a required tensor
KINDS = {"mode": "mode", "route": "route", "chunk_size": "chunk_size", "scale": "scale", "eps": "eps",
         "window": "window",
         "initial_state": "state", "cu_seqlens": "cu_seqlens", "D": "optional_tensor", "z": "optional_tensor",
         "delta_bias": "optional_tensor",
         **{flag: "bool" for flag in ("output_final_state", "normalize", "causal", "return_lse", "allow_neg_eigval",
                                        "delta_softplus")}}

# not ops: what ``subquad.ops`` exports beside them, and why the matrix leaves each out
NOT_OPS = {
    "MODES": "a constant", "OPS": "a constant", "RECURRENT_OPS": "a constant", "FEATURE_MAPS": "a constant",
    "set_checks": "a global switch taking one flag, refused otherwise (tests/ops/test_precision.py)",
    "feature_map": "a factory of nn.Modules by name (tests/ops/test_feature_maps.py)",
    "Transition": "a dataclass declaring an op's state-passing transition (tests/layers/test_table.py)",
    "transition_of": "reads an op's declared Transition (tests/distributed)",
    "KVCache": "a class: its constructor is checked in test_bad_input.py; as an op's state it is in the matrix",
}

# (family or "*", argument, value label) -> why that "bad" value is in fact valid: the call must succeed
GATES = ("g", "beta", "dt", "A", "D", "w", "i", "delta_bias")
VALID = {
    **{("*", name, "none"): "optional: None means absent" for name in ("D", "z", "cu_seqlens", "delta_bias")},
    ("*", "scale", "none"): "None means K ** -0.5",
    ("*", "route", "none"): "None picks the route by the thresholds of routes.py",
    ("*", "window", "none"): "None means no window",
    ("*", "initial_state", "none"): "None starts from the empty state",
    ("linformer_attention", "chunk_size", "none"): "Linformer's default: every query at once",
    **{("*", name, "float64"): "a gate may be float32 or float64 beside any activations" for name in GATES},
    **{("rg_lru", "x", d): "x is the one activation: any float dtype beside its float32 gate g"
       for d in ("float16", "float64")},
    **{("linformer_attention", p, d): "a projection is a parameter, cast to q's dtype"
       for p in ("E", "F") for d in ("float16", "float64")},
    **{("merge_attention", p, d): "a log-sum-exp is kept in float32 (or float64) beside 16-bit outputs"
       for p in ("lse1", "lse2") for d in ("float16", "float64")},
}

# (kind, class) with no value to try, and why
NOT_APPLICABLE = {
    ("bool", "size"): "a flag has no size and no range",
    ("mode", "size"): "a mode is a name; any other name is the str_for_bool class",
    ("route", "size"): "a route is a name; any other name is the str_for_bool class",
    ("scale", "size"): "every finite scale is valid: 0 is uniform attention, < 0 reverses the scores",
}

META = torch.device("meta")


def _grow(t):
    """t with dim 0 one longer: a batch, head or row count that no longer matches the others."""
    return torch.cat([t, t[:1]])


def _tensor_values(good, cls):
    """[(label, value)] of class ``cls`` for a tensor argument whose valid value is ``good``."""
    return {
        "rank": [("rank+1", good.unsqueeze(0))],
        "dtype": [("int64", good.long()), ("bool", good.bool()), ("float16", good.half()),
                  ("float64", good.double())],
        "none": [("none", None)],
        "list": [("list", good.tolist())],
        "size": [("dim0+1", _grow(good))],
        "nonfinite": [("nan", float("nan")), ("inf", float("inf"))],
        "str_for_bool": [("str", "no")],
        "meta": [("meta", good.to(META))],
    }[cls]


def _state_values(good, cls):
    """Bad initial states from a valid one: a tensor, a pair (S, z) or a KV cache's pair (k, v). The class
    is applied to the first tensor of a pair, the second kept."""
    if isinstance(good, torch.Tensor):
        return _tensor_values(good, cls)
    if cls == "list":
        return [("list", [t.tolist() for t in good])]
    return [(label, value if not isinstance(value, torch.Tensor) else (value, *good[1:]))
            for label, value in _tensor_values(good[0], cls)]


def _scalar_values(kind, cls):
    """[(label "class:value", value)] for a scalar argument, or None where the class has no value."""
    meta = lambda x: torch.tensor(x, device=META)                               # noqa: E731
    table = {
        "bool": {"rank": [torch.tensor([True])], "dtype": [1, 1.0], "none": [None], "list": [[True]],
                 "nonfinite": [float("nan")], "str_for_bool": ["no"], "meta": [meta(True)]},
        "mode": {"rank": [torch.tensor([0])], "dtype": [1], "none": [None], "list": [["chunk"]],
                 "nonfinite": [float("nan")], "str_for_bool": ["no"], "meta": [meta(0)]},
        "route": {"rank": [torch.tensor([0])], "dtype": [1], "none": [None], "list": [["exact"]],
                  "nonfinite": [float("nan")], "str_for_bool": ["no"], "meta": [meta(0)]},
        "chunk_size": {"rank": [torch.tensor([4])], "dtype": [4.0, True], "none": [None], "list": [[4]],
                       "size": [0, -1], "nonfinite": [float("nan"), float("inf")], "str_for_bool": ["64"],
                       "meta": [meta(4)]},
        "scale": {"rank": [torch.tensor([1.0])], "dtype": [True, 1j], "none": [None], "list": [[1.0]],
                  "nonfinite": [float("nan"), float("inf"), float("-inf")], "str_for_bool": ["no"],
                  "meta": [meta(1.0)]},
        "eps": {"rank": [torch.tensor([1e-6])], "dtype": [True], "none": [None], "list": [[1e-6]],
                "size": [-1e-6], "nonfinite": [float("nan"), float("inf"), float("-inf")], "str_for_bool": ["no"],
                "meta": [meta(1e-6)]},
        "window": {"rank": [torch.tensor([2])], "dtype": [2.0, True], "none": [None], "list": [[2]], "size": [-1],
                   "nonfinite": [float("nan"), float("inf")], "str_for_bool": ["no"], "meta": [meta(2)]},
        "cu_seqlens": {"rank": [torch.tensor([[0, 2, T]])], "dtype": [torch.tensor([0.0, 2.0, T])],
                       "none": [None], "list": [[0, 2, T]], "size": [torch.tensor([0, 2, T + 1])],
                       "nonfinite": [float("nan")], "str_for_bool": ["no"],
                       "meta": [torch.tensor([0, 2, T], device=META)]},
    }
    if cls not in table[kind]:
        return None
    return [(f"{cls}:{'tensor' if isinstance(v, torch.Tensor) else repr(v)}", v) for v in table[kind][cls]]


def public_ops():
    names = [n for n in ops.__all__ if n not in NOT_OPS]
    return sorted(names)


def _good_state(name, fn, args):
    """A valid initial state for ``name``: the final state of the base call (a cache as its (k, v) pair)."""
    state = fn(*args, output_final_state=True)[1]
    return (state.k, state.v) if isinstance(state, ops.KVCache) else state


def _optional_good(name, param):
    """Valid values of the optional tensor arguments, to spoil."""
    x = inputs(name)["x"]
    if param == "D":
        return torch.randn(x.shape[2])
    if param == "delta_bias":                                                     # keeps dt + bias >= 0
        return torch.rand(x.shape[2])
    return torch.randn(x.shape)                                                   # z: x's shape


def cases(name):
    """[(argument, class, label, value, valid reason or None)] for one public op; a class with no value
    appears once with value NOT_APPLICABLE's reason."""
    fn = getattr(ops, name)
    base = inputs(name)
    family = FAMILY[name]
    out = []
    for param in inspect.signature(fn).parameters.values():
        kind = "tensor" if param.kind == param.POSITIONAL_OR_KEYWORD else KINDS[param.name]
        if name == "linformer_attention" and param.name == "initial_state":
            kind = "no_state"
        for cls in CLASSES:
            if kind == "tensor":
                values = _tensor_values(base[param.name], cls)
            elif kind == "optional_tensor":
                values = _tensor_values(_optional_good(name, param.name), cls)
            elif kind == "state":
                values = _state_values(_good_state(name, fn, list(base.values())), cls)
            elif kind == "no_state":                        # Linformer: anything but None is refused
                values = [(cls, None)] if cls == "none" else _tensor_values(torch.zeros(1), cls)
            else:
                values = _scalar_values(kind, cls)
            if values is None:
                assert (kind, cls) in NOT_APPLICABLE, (name, param.name, cls)
                continue
            for label, value in values:
                key = label.split(":")[0]                    # a scalar's label is "class:value"
                reason = VALID.get((family, param.name, key)) or VALID.get(("*", param.name, key))
                out.append((param.name, cls, label, value, reason))
    return out


def names(msg: str, arg: str) -> bool:
    """The message names ``arg`` as its subject ("arg must", "arg's", "initial_state[0]", "E and F", "mode=")
    - not merely as a letter of a shape layout such as (B, T, H, K)."""
    after = r"(?:\s+must|'s|\[|:|\s+and\s|\s+was|\s+needs|\s+of shape|\s*/" + ("|=" if len(arg) > 1 else "") + ")"
    return re.search(rf"(?<![\w(,=]){re.escape(arg)}{after}", msg) is not None


def _call(fn, base, param, value):
    args = dict(base)
    if param in args:
        args[param] = value
        return fn(*args.values())
    return fn(*args.values(), **{param: value})


@pytest.mark.parametrize("name", public_ops())
def test_every_bad_argument_is_refused_naming_it(name):
    fn, base = getattr(ops, name), inputs(name)
    silent, unclear = [], []
    for param, cls, label, value, reason in cases(name):
        try:
            _call(fn, base, param, value)
        except (ValueError, TypeError) as e:
            if reason is not None:
                unclear.append(f"{param}={label} should be valid ({reason}): {type(e).__name__}: {e}")
            elif not names(str(e), param):
                unclear.append(f"{param}={label}: the message does not name {param}: {e}")
        except Exception as e:                                                    # noqa: BLE001
            unclear.append(f"{param}={label}: {type(e).__name__}: {e}")
        else:
            if reason is None:
                silent.append(f"{param}={label} ({cls})")
    assert not silent and not unclear, f"{name}: silently accepted {silent}; unclear {unclear}"


def test_every_public_op_is_in_the_matrix():
    assert set(public_ops()) == set(FAMILY), "a new public op: add its inputs to tests/ops/tiny.py"


@pytest.mark.parametrize("name", public_ops())
def test_every_argument_has_a_kind(name):
    for p in inspect.signature(getattr(ops, name)).parameters.values():
        assert p.kind == p.POSITIONAL_OR_KEYWORD or p.name in KINDS, f"{name}({p.name}=...): classify it in KINDS"


def test_names_reads_the_subject_not_a_layout_letter():
    assert names("B must have shape (1, 5, 3)", "B")
    assert names("k must match q's shape (B, T, H, K)", "q")
    assert not names("x must be a floating-point tensor (B, T, Dm)", "B")
    assert not names("dt must have shape (1, 5, 8) (for x of shape (1, 5, 8)), got (2, 5, 8)", "B")
