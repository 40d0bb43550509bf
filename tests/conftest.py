import os

import pytest
import torch
from hypothesis import settings

# Bounded property tests: the whole suite must stay well under 10 minutes on 2 cores.
settings.register_profile("subquad", max_examples=int(os.environ.get("SUBQUAD_HYPOTHESIS_EXAMPLES", 12)),
                          deadline=None, derandomize=False)
settings.load_profile("subquad")
torch.set_num_threads(min(2, torch.get_num_threads()))

# SUBQUAD_TEST_DEVICE=cuda make test: the whole suite (the float64 three-form battery included) on another
# device. Tensors made without an explicit device land there, and so do the generators the tests seed
# (a CPU generator cannot drive torch.randn on another device). Off by default: CI runs on the CPU.
_DEVICE = os.environ.get("SUBQUAD_TEST_DEVICE")
if _DEVICE and _DEVICE != "cpu":
    torch.set_default_device(_DEVICE)
    _Generator = torch.Generator

    def _generator(device=None):
        return _Generator(device=device if device is not None else _DEVICE)

    torch.Generator = _generator

# SUBQUAD_REQUIRE_REFERENCES=1 (set by `make test`, which installs the `test`, `hf`, `serve`, `eval` and `rwkv` extras): the
# reference packages those extras install must import. A test's pytest.importorskip of one of them fails,
# at collection or in the test, instead of skipping; other modules still skip.
REFERENCES = ("transformers", "openai", "fastapi", "uvicorn", "jinja2", "lm_eval", "accelerate", "rwkv")
if os.environ.get("SUBQUAD_REQUIRE_REFERENCES") == "1":
    _importorskip = pytest.importorskip

    def _importorfail(modname, *args, **kwargs):
        try:
            return _importorskip(modname, *args, **kwargs)
        except pytest.skip.Exception as e:
            if modname.split(".")[0] not in REFERENCES:
                raise
            pytest.fail(f"SUBQUAD_REQUIRE_REFERENCES=1 and {e}; the extras install it: "
                        "pip install -e '.[test,hf,serve,eval,rwkv]'", pytrace=False)

    pytest.importorskip = _importorfail


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small local corpus of code, and a token cache private to the test (the CLI and run tests)."""
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "code.py"
    path.write_text("".join(f"def h{i}(z):\n    return z * {i}\n\n" for i in range(400)))
    return path
