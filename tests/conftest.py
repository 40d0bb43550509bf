import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Bounded property tests: the whole suite must stay well under 12 minutes on 2 cores.
settings.register_profile("subquad", max_examples=int(os.environ.get("SUBQUAD_HYPOTHESIS_EXAMPLES", 12)),
                          deadline=None, derandomize=False)
settings.load_profile("subquad")
# Under pytest-xdist (`make test` runs `-n 2`) each worker process gets one thread: two processes of two
# threads on two cores would only fight over them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

# torch.compile's caches (inductor's FX graph and kernel caches) in the repository, not /tmp: the test workers
# share them, later runs reuse them, `make clean` removes them, and git ignores them (never committed).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "inductor"))
# and so are compile_decode's saved graphs (models.decode's cache), not the user's ~/.cache/subquad/decode
os.environ.setdefault("SUBQUAD_COMPILE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "decode"))

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

# SUBQUAD_REQUIRE_REFERENCES=1 (set by `make test`, which installs the `test`, `hf`, `serve`, `eval`, `rwkv` `grammar` and `gguf` extras): the
# reference packages those extras install must import. A test's pytest.importorskip of one of them fails,
# at collection or in the test, instead of skipping; other modules still skip.
REFERENCES = ("transformers", "openai", "fastapi", "uvicorn", "jinja2", "lm_eval", "accelerate", "rwkv", "llguidance", "gguf")
if os.environ.get("SUBQUAD_REQUIRE_REFERENCES") == "1":
    _importorskip = pytest.importorskip

    def _importorfail(modname, *args, **kwargs):
        try:
            return _importorskip(modname, *args, **kwargs)
        except pytest.skip.Exception as e:
            if modname.split(".")[0] not in REFERENCES:
                raise
            pytest.fail(f"SUBQUAD_REQUIRE_REFERENCES=1 and {e}; the extras install it: "
                        "pip install -e '.[test,hf,serve,eval,rwkv,gguf]'", pytrace=False)

    pytest.importorskip = _importorfail


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small local corpus of code, and a token cache private to the test (the CLI and run tests)."""
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "code.py"
    path.write_text("".join(f"def h{i}(z):\n    return z * {i}\n\n" for i in range(400)))
    return path


# `make test-quick`: the cases named in tests/quick.txt (a few fast ones from every test file, chosen from a
# timed run by tests/quick_select.py) carry the `quick` mark. Ids in the list that a collected file no longer
# has are kept in QUICK_MISSING, which tests/test_quick.py asserts is empty.
QUICK_LIST = Path(__file__).parent / "quick.txt"
QUICK_MISSING: list[str] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the iteration subset listed in tests/quick.txt (make test-quick)")


@pytest.hookimpl(tryfirst=True)            # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    quick = {ln.strip() for ln in QUICK_LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    ids = set()
    for item in items:
        ids.add(item.nodeid)
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
    files = {i.split("::")[0] for i in ids}
    QUICK_MISSING[:] = sorted(q for q in quick if q.split("::")[0] in files and q not in ids)
