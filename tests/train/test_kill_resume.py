"""SIGKILL at chosen points - inside a step, inside save_checkpoint, between the rename and ``latest`` -
then resume: the final weights are bit-identical to an uninterrupted run and metrics.jsonl holds every
step exactly once."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from subquad.train import load_checkpoint

CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from subquad.models import ModelConfig
    from subquad.train import TrainConfig, train_run
    import subquad.train.checkpoint as ck
    import subquad.train.trainer as tr

    out, data, kill, resume = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    torch.set_num_threads(1)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    what, _, n = kill.partition(":")
    count = [0]
    if what == "step":                      # killed inside step n, after its batch is drawn
        orig_batch = tr.get_batch
        def get_batch(*a):
            count[0] += 1
            if count[0] == int(n):
                die()
            return orig_batch(*a)
        tr.get_batch = get_batch
    elif what == "save":                    # killed inside the n-th save, after the model file is written
        orig_hash = ck._sha256
        def sha(path):
            if path.name == "model.safetensors":
                count[0] += 1
                if count[0] == int(n):
                    die()
            return orig_hash(path)
        ck._sha256 = sha
    elif what == "latest":                  # killed after the n-th rename, before ckpt/latest moves
        orig_replace = ck.os.replace
        def replace(src, dst):
            if str(dst).endswith("latest"):
                count[0] += 1
                if count[0] == int(n):
                    die()
            return orig_replace(src, dst)
        ck.os.replace = replace
    mcfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, context_length=32, pattern="linear,swa",
                       mixer_options={"swa": {"window": 8}})
    tcfg = TrainConfig(steps=8, batch_size=2, lr=3e-3, warmup=2, eval_every=4, eval_batches=2, ckpt_every=3)
    train_run(mcfg, tcfg, out, data=data, resume=resume, progress=False, log=lambda m: None)
""")


def child(out, data, kill="none", resume=False):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "SUBQUAD_CACHE": str(Path(data).parent / "cache")}          # the token cache private to these runs
    return subprocess.run([sys.executable, "-c", CHILD, str(out), str(data), kill, "1" if resume else "0"],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    data = root / "code.py"
    data.write_text("".join(f"def k{i}(z):\n    return z - {i}\n\n" for i in range(300)))
    ref = child(root / "ref", data)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return root, data, load_checkpoint(root / "ref")[0]


@pytest.mark.parametrize("kill", ["step:2", "step:5", "save:2", "latest:2", "save:3"])
def test_killed_run_resumes_bit_identically(setup, kill):
    root, data, ref = setup
    out = root / kill.replace(":", "_")
    first = child(out, data, kill)
    assert first.returncode == -9, (first.returncode, first.stderr[-2000:])
    again = child(out, data, "none", resume=True)
    assert again.returncode == 0, again.stderr[-3000:]
    got, _, meta = load_checkpoint(out)
    assert meta["step"] == 8 and all(torch.equal(got[k], ref[k]) for k in ref)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
