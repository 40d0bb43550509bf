"""SIGKILL at chosen points - inside a step, inside save_checkpoint, between the rename and ``latest`` -
then resume: the final weights are bit-identical to an uninterrupted run and metrics.jsonl holds every
step exactly once."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from subquad.train import load_checkpoint
from tests.forked import context


def run_child(out, data, kill, resume, log):
    """One training run in a process of its own, killed (SIGKILL) at ``kill``, then or else run to the end;
    its stderr goes to ``log``."""
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ["SUBQUAD_CACHE"] = str(Path(data).parent / "cache")      # the token cache private to these runs
    from subquad.models import ModelConfig
    from subquad.train import TrainConfig, train_run
    import subquad.train.checkpoint as ck
    import subquad.train.trainer as tr

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


def child(out, data, kill="none", resume=False):
    """(exit code, stderr) of one run in a new process (forked from the tests' forkserver, tests/forked.py,
    without a fresh interpreter's seconds of imports: 11 runs): -9 when killed."""
    log = Path(str(out) + f".{kill.replace(':', '_')}.{int(resume)}.stderr")
    p = context().Process(target=run_child, args=(str(out), str(data), kill, resume, str(log)))
    p.start()
    p.join(300)
    if p.exitcode is None:
        p.kill()
        p.join()
        pytest.fail(f"the run ({kill}, resume={resume}) took over 300 s")
    return p.exitcode, log.read_text() if log.exists() else ""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    data = root / "code.py"
    data.write_text("".join(f"def k{i}(z):\n    return z - {i}\n\n" for i in range(300)))
    code, err = child(root / "ref", data)
    assert code == 0, err[-3000:]
    return root, data, load_checkpoint(root / "ref")[0]


@pytest.mark.parametrize("kill", ["step:2", "step:5", "save:2", "latest:2", "save:3"])
def test_killed_run_resumes_bit_identically(setup, kill):
    root, data, ref = setup
    out = root / kill.replace(":", "_")
    code, err = child(out, data, kill)
    assert code == -9, (code, err[-2000:])
    code, err = child(out, data, "none", resume=True)
    assert code == 0, err[-3000:]
    got, _, meta = load_checkpoint(out)
    assert meta["step"] == 8 and all(torch.equal(got[k], ref[k]) for k in ref)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
