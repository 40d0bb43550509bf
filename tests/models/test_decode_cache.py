"""The compiled step's cache across processes (models.decode): a second process loads the saved graphs instead of
compiling them, and its logits equal the eager step's; another model's shape or config names other files; an
unreadable file is ignored and rewritten; a loaded batch-2 graph refuses batch 1 (its guards), which gets a
graph of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.decode import CompiledStep, _for_graph, cache_key, compile_decode

ROOT = Path(__file__).resolve().parents[2]
CFG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "pattern": "softmax", "context_length": 64}


def run_steps(cache) -> dict:
    """One process's steps: batch 2 then batch 1 (a row of it) from a prompt of 5, each against the eager step."""
    from subquad.models.rows import select_rows

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**CFG)).eval()
    errs = []
    with torch.no_grad():
        logits, state = model.prefill(torch.randint(0, 64, (2, 5)))
        tok = logits[:, -1].argmax(-1)
        step = compile_decode(model, cache=cache)._decode_step
        for rows in ([0, 1], [1]):
            s, t = select_rows(state, rows), tok[rows]
            ref, _ = compile_decode(model, False).step(t, s)
            model._decode_step = step
            out, _ = model.step(t, s)
            errs.append(((out - ref).abs().max() / ref.abs().max()).item())
    return {"errs": errs, "loaded": step.loaded, "compiled": step.compiled, "fallback": step.fallback,
            "graphs": len(step.graphs), "key": cache_key(model), "threads": torch.get_num_threads()}


CHILD = ("import json, sys, torch; torch.set_num_threads(int(sys.argv[1])); "
         "from tests.models.test_decode_cache import run_steps; print(json.dumps(run_steps(sys.argv[2])))")


def _steps_in_a_process(cache) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(torch.get_num_threads()), str(cache)], check=False,
                         cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved():
    """A cache folder of this test process's own (under tests/conftest.py's .cache/decode: the test workers never
    write each other's files while one reads them) where this process compiled or loaded the step at batch 2
    and at batch 1: a compile on the first run, a load on later runs (~2 minutes against ~10 s on 2 busy
    cores)."""
    cache = Path(os.environ["SUBQUAD_COMPILE_CACHE"]) / f"tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    return cache, run_steps(cache)


def test_a_second_process_loads_the_step_and_batch_1_after_batch_2_is_right(saved, tmp_path):
    """Two fresh processes (as a user's: this test process's global state, after the suite's other tests, is not
    theirs): the first compiles and saves, the second loads."""
    cache, first = saved
    assert first["compiled"] + first["loaded"] == first["graphs"] == 2 and first["fallback"] is None
    cache = tmp_path
    first = _steps_in_a_process(cache)
    assert (first["loaded"], first["compiled"], first["graphs"], first["fallback"]) == (0, 2, 2, None), first
    second = _steps_in_a_process(cache)
    assert (second["key"], second["threads"]) == (first["key"], first["threads"])
    assert (second["loaded"], second["compiled"], second["graphs"], second["fallback"]) == (2, 0, 2, None), \
        (second, sorted(p.name for p in cache.iterdir()))
    assert max(first["errs"] + second["errs"]) <= 1e-5


def test_a_loaded_batch_2_graph_refuses_batch_1(saved):
    cache, _ = saved
    torch.manual_seed(0)
    model = compile_decode(LanguageModel(ModelConfig(**CFG)).eval(), cache=cache)
    with torch.no_grad():
        logits, state = model.prefill(torch.randint(0, 64, (2, 5)))
        model.step(logits[:, -1].argmax(-1), state)          # loads the batch-2 graph
        step = model._decode_step
        assert (step.loaded, step.compiled) == (1, 0)
        tokens = logits[:1, -1].argmax(-1, keepdim=True)
        h, _ = model._embed_tokens(tokens, None)
        one = [{k: _for_graph(v[:1] if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in state]
        assert not step.graphs[0].guard_check(model, h, one, tokens)


def test_another_shape_or_config_misses_the_cache():
    torch.manual_seed(0)
    a = LanguageModel(ModelConfig(**CFG)).eval()
    same = LanguageModel(ModelConfig(**CFG)).eval()
    wider = LanguageModel(ModelConfig(**{**CFG, "d_model": 48})).eval()
    eps = LanguageModel(ModelConfig(**{**CFG, "norm_eps": 1e-5})).eval()
    assert cache_key(a) == cache_key(same)                   # the weights' values are inputs, not part of the key
    assert len({cache_key(a), cache_key(wider), cache_key(eps)}) == 3
    lin = next(m for m in a.blocks.modules() if isinstance(m, torch.nn.Linear))
    lin.weight = torch.nn.Parameter(lin.weight.detach().T.contiguous().T)      # column-major: other strides
    assert cache_key(a) != cache_key(same)


def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(saved, tmp_path):
    """Every saved graph of the model truncated in a copy of the cache: the step warns, compiles and saves."""
    cache, _ = saved
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**CFG)).eval()
    for good in cache.glob(f"{cache_key(model)}-*.bin"):
        (tmp_path / good.name).write_bytes(good.read_bytes()[:1000])
    with torch.no_grad():
        logits, state = model.prefill(torch.randint(0, 64, (2, 5)))
        tok = logits[:, -1].argmax(-1)
        ref, _ = model.step(tok, state)
        compile_decode(model, cache=tmp_path)
        with pytest.warns(UserWarning, match="unreadable saved graph"):
            out, _ = model.step(tok, state)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    rewritten = [p for p in tmp_path.glob("*.bin") if p.stat().st_size > 1000]
    assert len(rewritten) == 1 and CompiledStep._load(rewritten[0]) is not None


def test_cache_false_and_bad_arguments(tmp_path):
    model = LanguageModel(ModelConfig(**CFG)).eval()
    assert compile_decode(model, cache=False)._decode_step.fallback == "cache=False"
    assert compile_decode(model, cache=tmp_path)._decode_step.cache == tmp_path
    with pytest.raises(ValueError, match="cache"):
        compile_decode(model, cache=3)
