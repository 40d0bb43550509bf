"""The README's op-contract example runs as written."""

import re
import sys

import torch
from pathlib import Path


def test_readme_op_example_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"### The op contract\s+```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["o"].shape == (2, 1000, 4, 32) and scope["lse"].shape == (2, 1000, 4)
    assert scope["o2"].shape == (2, 1, 4, 32)


def test_readme_precision_example_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"### Precision, devices and `torch.compile`\s+```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["logits"].dtype == scope["torch"].bfloat16 and scope["loss"].isfinite()
    assert all(p.grad is not None for p in scope["model"].parameters() if p.requires_grad)


def test_readme_python_api_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"### Python API\s+```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert len(scope["outs"]) == 2 and all(len(o) == 12 for o in scope["outs"])
    assert scope["meta"]["step"] == 20


def test_readme_new_mixer_example_runs_registers_and_passes_the_battery(tmp_path, monkeypatch):
    """The block as a module (the battery's ranks are spawned and import it): it registers ``tiny_decay`` and
    passes the battery; two ranks equal one process; the name works in a pattern."""
    import importlib

    from subquad.layers.registry import MIXERS
    from subquad.models import LanguageModel, ModelConfig
    from subquad.testing import check_mixer

    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"### Layers: equations in.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "readme_tiny_decay.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mod = importlib.import_module("readme_tiny_decay")              # runs check_mixer("tiny_decay")
        assert MIXERS["tiny_decay"].cls is mod.TinyDecay
        check_mixer("tiny_decay", checks=[], context_parallel=True)
        torch.manual_seed(0)
        m = mod.TinyDecay(16, chunk_size=4).double()
        x = torch.randn(2, 11, 16, dtype=torch.float64)
        y, _ = m(x)
        y1, s = m(x[:, :6], m.empty_state(2, dtype=torch.float64))
        y2, _ = m(x[:, 6:], s)
        torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-12)
        cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, pattern="tiny_decay*2,softmax")
        assert [b.mixer_name for b in LanguageModel(cfg).blocks] == ["tiny_decay", "tiny_decay", "softmax"]
    finally:
        MIXERS.pop("tiny_decay", None)
        sys.modules.pop("readme_tiny_decay", None)


def test_readme_varlen_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"### Variable-length batches \(`cu_seqlens`\)\s+.*?```python\n(.*?)```", text, re.S).group(1)
    ns = {}
    exec(block, ns)
    assert ns["S"].shape == (3, 2, 8, 8) and ns["logits"].shape == (3, 1, 100)
