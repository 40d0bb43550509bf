"""`subquad train --fsdp` on 2 processes, resumed on 1 and exported: the user's path of a sharded run, from the
command line; and `--nnodes` through torchrun's rendezvous, two "machines" on this one."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from subquad.cli import main
from subquad.models import from_pretrained
from subquad.train import load_checkpoint, load_run

SMALL = ["--vocab-size", "300", "--d-model", "32", "--n-heads", "2", "--context", "32", "--batch-size", "2",
         "--no-progress"]


def _lines(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_fsdp_run_resumes_on_one_process_and_exports_for_transformers(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), *SMALL, "--pattern", "mamba2", "--n-layers", "2", "--no-mlp",
                 "--steps", "2", "--eval-every", "2", "--ckpt-every", "2", "--out", str(run), "--nproc", "2",
                 "--fsdp"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world"] == 2 and cfg["train"]["fsdp"] is True
    assert sorted(p.name for p in (run / "ckpt" / "step_0000002").glob("*.distcp")) == ["__0_0.distcp",
                                                                                         "__1_0.distcp"]
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--batches", "1"]) == 0             # the shards, read whole
    assert "step 2, held-out loss" in capsys.readouterr().out
    # the sharded run continues on one process (no --fsdp there: the flag is the run's layout, not its math)
    assert main(["train", "--resume", "--out", str(run), "--steps", "3", "--no-fsdp", "--no-progress"]) == 0
    assert [r["step"] for r in _lines(run)] == [1, 2, 3]
    batch = cfg["train"]["batch_size"]                      # the sequences a step halve with the processes: said
    assert (f"the run trained on 2 processes ({2 * batch} sequences a step); it continues on 1 process: {batch} "
            f"sequences a step, each process drawing --batch-size {batch}") in capsys.readouterr().out
    _, _, meta = load_checkpoint(run)
    assert meta["step"] == 3 and meta.get("format") is None          # one process writes a full checkpoint
    capsys.readouterr()

    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "as a Hugging Face mamba2 folder" in capsys.readouterr().out
    ours, _, _ = load_run(run)
    back, tok = from_pretrained(tmp_path / "hf")
    assert back.config.eos_token_ids == [tok.token_to_id("<|endoftext|>")]   # the folder names its end of text
    ids = torch.tensor([tok.encode("def k1(a):\n").ids])
    with torch.no_grad():
        want = ours(ids)
        assert torch.allclose(back(ids), want, atol=1e-5)
        transformers = pytest.importorskip("transformers")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert torch.allclose(theirs(ids).logits, want, atol=1e-4, rtol=1e-4)


def test_export_of_a_structure_no_hugging_face_type_has_writes_a_subquad_folder(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), *SMALL, "--pattern", "gla,softmax", "--n-layers", "2",
                 "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "plain")]) == 0
    assert "as a subquad folder" in capsys.readouterr().out
    ours, _, _ = load_run(run)
    back, tok = from_pretrained(tmp_path / "plain")
    ids = torch.tensor([tok.encode("def k1(a):\n").ids])
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))
    # --quantize: the folder holds the quantised weights and loads as the same quantised model
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "q"), "--quantize", "int4"]) == 0
    assert "a subquad folder of int4 weights" in capsys.readouterr().out
    qback, _ = from_pretrained(tmp_path / "q")
    with torch.no_grad():         # (the folder's float matrices are laid out for decoding: last bits may differ)
        want = load_run(run, quantize="int4")[0](ids)
        assert qback.quantized == "int4" and torch.allclose(qback(ids), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    with pytest.raises(SystemExit):
        main(["export", "--run", str(run), "--out", str(tmp_path / "x"), "--model-type", "nonesuch"])
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "x"), "--model-type", "mamba2"]) != 0
    assert "cannot be written as model_type 'mamba2'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_the_rendezvous_endpoint(tmp_path, corpus):
    """`--nnodes 2 --rdzv-endpoint` on two 'machines' (two launches here, one process each): one FSDP run of
    world 2."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "subquad", "train", "--data", str(corpus), *SMALL, "--pattern", "linear",
           "--n-layers", "2", "--steps", "2", "--eval-every", "2", "--ckpt-every", "2", "--out", str(run),
           "--fsdp", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--dist-timeout", "60"]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert all(n.returncode == 0 for n in nodes), outs
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world"] == 2 and cfg["train"]["fsdp"] is True
    assert [r["step"] for r in _lines(run)] == [1, 2]
