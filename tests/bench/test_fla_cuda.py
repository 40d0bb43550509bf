"""benchmarks/bench_fla_cuda.py calls flash-linear-attention by its keyword API: checked against a stub ``fla``
whose functions take fla's signatures (``head_first``, GLA's ``gk`` in the recurrent form, linear attention's
``normalize``) and compute with subquad's ops, so every row runs and agrees exactly."""

import sys
import textwrap

import pytest
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import benchmarks.bench_fla_cuda as bench  # noqa: E402

# fla module -> (subquad op, the chunk form's gates, the recurrent form's gates)
STUB = {"linear_attn": ("linear_attention", [], []), "simple_gla": ("simple_gla", ["g"], ["g"]),
        "gla": ("gla", ["g"], ["gk"]), "delta_rule": ("delta_rule", ["beta"], ["beta"]),
        "gated_delta_rule": ("gated_delta_rule", ["g", "beta"], ["g", "beta"])}


def _function(name, op, gates, mode, linear):
    params = "".join(f"{g}=None, " for g in gates)
    norm = ", normalize=True" if linear else ""
    return textwrap.dedent(f"""
        def {name}(q, k, v, {params}scale=None, initial_state=None, output_final_state=False, head_first=True{norm}):
            assert head_first is False{' and normalize is False' if linear else ''}
            return ops.{op}(q, k, v, {''.join(g + ', ' for g in gates)}mode={mode!r}, scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state
                            {', normalize=False' if linear else ''})
        """)


@pytest.fixture
def stub_fla(tmp_path, monkeypatch):
    for module, (op, chunk_gates, rec_gates) in STUB.items():
        folder = tmp_path / "fla" / "ops" / module
        folder.mkdir(parents=True)
        linear = module == "linear_attn"
        folder.joinpath("__init__.py").write_text(
            "from subquad import ops\n" + _function(f"chunk_{module}", op, chunk_gates, "chunk", linear)
            + _function(f"fused_recurrent_{module}", op, rec_gates, "recurrent", linear))
    for d in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        d.joinpath("__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_fla()
    yield
    _forget_fla()                                                  # the stub stays out of later imports


def _forget_fla():
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]


def test_every_row_calls_the_peer_by_its_api_and_agrees(stub_fla, monkeypatch):
    monkeypatch.setattr(bench, "B", 1)
    monkeypatch.setattr(bench, "H", 2)
    monkeypatch.setattr(bench, "K", 16)
    rows = bench.run(torch.empty(0).device, [32], repeats=1)
    assert len(rows) == 4 * len(bench.OPS)
    assert [r["error"] for r in rows] == [None] * len(rows)
    assert all(r["rel_diff"] == 0 for r in rows if r["impl"] == "fla")
    assert all(r["fwdbwd"] is not None for r in rows if r["kind"] == "op")


def test_a_missing_peer_is_a_row_with_its_reason(monkeypatch):
    for name in ("fla", "fla.ops", "fla.ops.gla"):
        monkeypatch.setitem(sys.modules, name, None)               # import fla fails
    assert "fla.ops.gla.chunk_gla" in bench.theirs("gla", 1)
