import os
from pathlib import Path

# inductor compiles a graph's C++ in one process, not a pool of workers: on the 2-core machines the suite runs on,
# the pool's processes only fight the two test workers for the cores (a compiled decode test 15.4 -> 13.8 s alone).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402


def _inductor_at_o0():
    """Inductor builds the C++ of the tests' graphs at -O0, not -O3: the tests check what the graphs compute, and
    without -ffast-math the levels compute the same IEEE operations in the same order (inductor writes its
    vectorised loops out itself) but for -O1 and up contracting a * b + c into one fma - within the tests'
    tolerances, which hold the graphs to eager ATen's. The optimiser is most of a graph's C++ build time (an
    every-mixer compiled decode test, cold caches, AVX2 EPYC: 62 s at -O3, 52 at -O1; another day 75 s at -O1,
    66 at -O0), and the tests' graphs are too small for their unoptimised loops to matter. Users' graphs stay at
    -O3. The function is torch's private one: where it is missing or differs, the tests keep -O3."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:
        return
    flags = getattr(cpp_builder, "_get_optimization_cflags", None)
    if flags is None:
        return

    def at_o0(*args, **kwargs):
        cflags, ldflags = flags(*args, **kwargs)
        return ["O0" if f == "O3" else f for f in cflags], ldflags

    cpp_builder._get_optimization_cflags = at_o0


if os.environ.get("SUBQUAD_TEST_INDUCTOR_O3") != "1":
    _inductor_at_o0()

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
    import torch._dynamo  # noqa: F401  (imported before the patch: their annotations read `torch.Generator | None`)
    import torch.distributed.tensor  # noqa: F401

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


@pytest.fixture
def brief_evals(monkeypatch):
    """The workshop's runs measure their held-out loss on one batch, not eight: the tests of its mechanics (reuse,
    refusal, the CLI, a few steps each) need a loss, not a precise one, and at 2-3 steps the eight batches at
    every step were most of their time. The README's check run keeps the workshop's own configuration."""
    from dataclasses import replace

    from subquad.bench import workshop

    real = workshop.run_config

    def run_config(*args, **kwargs):
        mcfg, cfg = real(*args, **kwargs)
        return mcfg, replace(cfg, eval_batches=1)

    monkeypatch.setattr(workshop, "run_config", run_config)


# `make test-quick`: the cases named in tests/quick.txt (a few fast ones from every test file, chosen from a
# timed run by tests/quick_select.py) carry the `quick` mark. Ids in the list that a collected file no longer
# has are kept in QUICK_MISSING, which tests/test_quick.py asserts is empty.
QUICK_LIST = Path(__file__).parent / "quick.txt"
QUICK_MISSING: list[str] = []
COLLECTED: set[str] = set()                  # the node ids and files of this run's collection
COLLECTED_FILES: set[str] = set()


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the iteration subset listed in tests/quick.txt (make test-quick)")
    config.addinivalue_line("markers", "paced: speculation paced by wall time as users get it (see ``unpaced``)")


@pytest.fixture
def unpaced(request, monkeypatch):
    """Speculation's mechanics without its pacing: every step may draft and verify. ``models.speculative.Pacer``
    decides by wall time, which a loaded machine makes vary, so tests that count verifications, acceptance or
    tokens per step use this (``pytestmark = pytest.mark.usefixtures("unpaced")``); a test marked ``paced`` keeps
    the pacer."""
    from subquad.models.speculative import Pacer

    if request.node.get_closest_marker("paced") is None:
        monkeypatch.setattr(Pacer, "want", lambda self, key=None: True)


@pytest.hookimpl(tryfirst=True)            # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    quick = {ln.strip() for ln in QUICK_LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    ids = set()
    for item in items:
        ids.add(item.nodeid)
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
    files = {i.split("::")[0] for i in ids}
    COLLECTED.update(ids)
    COLLECTED_FILES.update(files)
    QUICK_MISSING[:] = sorted(q for q in quick if q.split("::")[0] in files and q not in ids)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        items[:] = heavy_first(items, read_heavy(), workers)


# Under pytest-xdist the cases measured slowest (tests/heavy.txt, seconds and id, from a timed run) start first,
# spread over the workers: xdist's worksteal hands each worker a contiguous share of the list and idle workers
# steal from the end of another's, so a long case left near the end of a share would run alone while the other
# worker waits (the wall time of `make test` is the busier worker's).
HEAVY_LIST = Path(__file__).parent / "heavy.txt"


def read_heavy() -> dict[str, float]:
    out = {}
    for ln in HEAVY_LIST.read_text().splitlines() if HEAVY_LIST.exists() else []:
        if ln.strip() and not ln.startswith("#"):
            seconds, nid = ln.split(maxsplit=1)
            out[nid.strip()] = float(seconds)
    return out


def heavy_first(items: list, heavy: dict[str, float], workers: int) -> list:
    """``items`` reordered so that worker w's contiguous share (xdist: len // workers each, the last the rest)
    starts with the heavy cases given to it - each to the share with the least heavy seconds so far, slowest
    first - and then continues with the other cases in their collected order."""
    slow = sorted((i for i in items if i.nodeid in heavy), key=lambda i: -heavy[i.nodeid])
    rest = [i for i in items if i.nodeid not in heavy]
    shares, load = [[] for _ in range(workers)], [0.0] * workers
    for item in slow:
        w = min(range(workers), key=lambda k: (load[k], k))
        shares[w].append(item)
        load[w] += heavy[item.nodeid]
    size = len(items) // workers
    out = []
    for w, share in enumerate(shares):
        room = size - len(share) if w < workers - 1 else len(rest)
        out += share + rest[:max(0, room)]
        rest = rest[max(0, room):]
    return out


# A test whose worker processes (tests/distributed/helpers.run, tests/forked) lose one to a signal - SIGABRT or
# SIGSEGV, the process dying inside a C++ library rather than an assertion failing - runs once more in a fresh
# tmp_path, with a warning that keeps the first failure. Seen once in CI: "malloc(): unaligned tcache chunk
# detected" in a gloo rank during a DCP save of test_sharded_checkpoints_reshard_4_to_2_to_1_and_1_to_4, not
# reproduced in 30 runs here; the ranks now print their stacks on such a signal (distributed.launch's worker,
# faulthandler). A second crash fails the test.
CRASH_SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS")
RANKS = ("tests/distributed/", "tests/train/test_parallelize.py", "tests/train/test_kill_resume.py")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not pyfuncitem.nodeid.startswith(RANKS):
        return None                                  # pytest's own call
    import warnings

    from torch.multiprocessing import ProcessExitedException

    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    try:
        pyfuncitem.obj(**args)
    except ProcessExitedException as e:
        if getattr(e, "signal_name", None) not in CRASH_SIGNALS:
            raise
        warnings.warn(f"{pyfuncitem.nodeid}: a worker process died ({e}); running the test once more", stacklevel=1)
        if isinstance(args.get("tmp_path"), Path):
            args["tmp_path"] = args["tmp_path"] / "rerun"
            args["tmp_path"].mkdir()
        pyfuncitem.obj(**args)
    return True
