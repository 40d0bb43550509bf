"""scripts/device_check.sh: valid bash, executable, its dry run names every step, and without a GPU it stops
with a clear message (exit 2) before running anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.sh"


def _run(*args, out):
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_script_is_executable_bash_that_parses():
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_names_every_step(tmp_path):
    r = _run("--dry-run", out=tmp_path)
    assert r.returncode == 0, r.stderr
    for words in ("SUBQUAD_TEST_DEVICE=cuda", "-m pytest -x", "torch.distributed.run --standalone --nproc-per-node 2",
                  "--device cuda --fsdp", "benchmarks/bench_fla_cuda.py --quick"):
        assert words in r.stdout, words
    assert not (tmp_path / "summary.txt").read_text()               # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run the checks")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    r = _run(out=tmp_path)
    assert r.returncode == 2
    assert "torch sees no CUDA GPU" in r.stdout and "--dry-run" in r.stdout
