"""The README's op-contract example runs as written."""

import re
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
