"""The corners a fault-injection run and a new user hit (issue 32): an unreadable or escaping
``ckpt/latest``, the newest intact step against an older ``latest``, a full disk during a checkpoint,
changed data or a truncated tokenizer on resume, lost checkpoints, a torn metrics line, a NaN held-out
loss, the schedule's length on resume, and what eval / generate say about the checkpoint they use."""

import errno
import json
import math
import shutil

import pytest
import torch

from subquad.cli import main
from subquad.data import prepare
from subquad.models import LanguageModel, ModelConfig
from subquad.train import TrainConfig, Trainer, TrainingDiverged, load_checkpoint
from subquad.train.checkpoint import find_checkpoint
from subquad.train.trainer import read_metrics


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A corpus folder, a token cache private to this module, and a finished 4-step run (checkpoints at
    steps 2 and 4) that tests copy instead of training again."""
    root = tmp_path_factory.mktemp("faults")
    data = root / "data"
    data.mkdir()
    for name in ("a.py", "b.py"):
        (data / name).write_text("".join(f"def {name[0]}{i}(z):\n    return z * {i}\n\n" for i in range(200)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUBQUAD_CACHE", str(root / "cache"))
        assert main(argv(data, root / "base", "--steps", "4")) == 0
        yield root, data


def argv(data, out, *extra):
    return ["train", "--data", str(data), "--vocab-size", "300", "--d-model", "16", "--n-layers", "1",
            "--n-heads", "2", "--context", "16", "--pattern", "linear", "--batch-size", "2", "--eval-every", "2",
            "--ckpt-every", "2", "--warmup", "1", "--out", str(out), "--no-progress", *extra]


def resume(run, *extra):
    return main(["train", "--out", str(run), "--resume", "--no-progress", *extra])


@pytest.fixture
def run(env, tmp_path, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(env[0] / "cache"))
    shutil.copytree(env[0] / "base", tmp_path / "run")
    return tmp_path / "run"


def steps_of(run):
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


# -- which checkpoint: the newest intact one by step number; ckpt/latest is a hint ---------------------


def test_a_non_utf8_latest_falls_back_to_the_newest_intact_checkpoint(run):
    (run / "ckpt" / "latest").write_bytes(b"\xff\xfe step_\x80\n")
    said = []
    assert find_checkpoint(run, said.append).name == "step_0000004"
    assert "ckpt/latest is unreadable" in said[0] and "using step_0000004" in said[0]


def test_latest_naming_a_checkpoint_outside_the_run_is_not_followed(run, tmp_path):
    shutil.copytree(run, tmp_path / "other")
    (run / "ckpt" / "step_0000004").rename(run / "ckpt" / "step_0000003")     # the run's newest is step 3
    (run / "ckpt" / "latest").write_text("../../other/ckpt/step_0000004\n")
    said = []
    found = find_checkpoint(run, said.append)
    assert found == run / "ckpt" / "step_0000003"
    assert "not a step folder of this run" in said[0] and "other" in said[0]


def test_the_newest_intact_step_wins_over_an_older_latest(run, capsys):
    """A kill between the rename of step 4 and the update of ckpt/latest: latest still names step 2."""
    (run / "ckpt" / "latest").write_text("step_0000002\n")
    said = []
    assert find_checkpoint(run, said.append).name == "step_0000004"
    assert "names step_0000002, but step_0000004 is newer and intact" in said[0]
    capsys.readouterr()
    assert resume(run, "--steps", "6") == 0
    assert "resuming" in capsys.readouterr().out and steps_of(run) == [1, 2, 3, 4, 5, 6]


def test_eval_and_generate_say_which_step_they_use_and_why(run, capsys):
    f = run / "ckpt" / "step_0000004" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-32])
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--batches", "1"]) == 0
    out, err = capsys.readouterr()
    assert "step 2," in out and "truncated or corrupted" in err and "using step_0000002" in err
    assert main(["generate", "--run", str(run), "--prompt", "def a1", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "truncated or corrupted" in err and "using step_0000002" in err


# -- writes that fail ------------------------------------------------------------------------------------


def full_disk_at(monkeypatch, nth: int, kind: str = "oserror"):
    """The nth tensor file written fails as a full disk does: an OSError(ENOSPC), or safetensors' own
    error carrying the OS error (what it raises on a real full disk)."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, count = safetensors.torch.save_file, [0]

    def save_file(tensors, path, *a, **k):
        count[0] += 1
        if count[0] == nth:
            real(tensors, path, *a, **k)                              # a partial file on disk, then the error
            if kind == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device", path)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("kind", ["oserror", "safetensors"])
def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_folder(env, tmp_path, monkeypatch,
                                                                                   capsys, kind):
    monkeypatch.setenv("SUBQUAD_CACHE", str(env[0] / "cache"))
    out = tmp_path / "full"
    full_disk_at(monkeypatch, 3, kind)                  # the model file of the second checkpoint (step 4)
    assert main(argv(env[1], out, "--steps", "6")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device: the last intact checkpoint is step 2"), err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["latest", "step_0000002"]


def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUBQUAD_CACHE", str(env[0] / "cache"))
    out = tmp_path / "fresh"
    assert main(argv(env[1], out, "--steps", "4", "--lr", "1e39")) == 2       # refused before anything is made
    err = capsys.readouterr().err
    assert "lr must be a finite number" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    full_disk_at(monkeypatch, 1)                                              # the first checkpoint
    assert main(argv(env[1], out, "--steps", "4")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device: there is no checkpoint yet"), err
    assert not out.exists()


def test_the_stop_message_says_when_there_is_no_checkpoint(env, tmp_path):
    td = prepare(str(env[1]), 300, log=lambda m: None)
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=td.tokenizer().get_vocab_size(), d_model=16, n_layers=1, n_heads=2,
                                  context_length=16, pattern="linear"))
    t = Trainer(m, td, TrainConfig(steps=6, batch_size=2, warmup=1, ckpt_every=2, eval_every=2, eval_batches=1),
                tmp_path / "r", progress=False)
    orig = m.forward
    m.forward = lambda idx, **kw: orig(idx, **kw) * (float("nan") if t.step in (0, 3) else 1.0)
    with pytest.raises(TrainingDiverged, match="There is no checkpoint yet") as e:
        t.fit()
    assert "kept in" not in str(e.value)
    t.step = 2                                                  # as if resumed from step 2's checkpoint
    t.save()
    with pytest.raises(TrainingDiverged, match="step 4; stopped. The last good checkpoint, step 2, is kept"):
        t.fit()


def test_a_nan_held_out_loss_with_skip_is_written_as_null_and_training_goes_on(env, tmp_path):
    td = prepare(str(env[1]), 300, log=lambda m: None)
    cfg = TrainConfig(steps=4, batch_size=2, warmup=1, ckpt_every=2, eval_every=2, eval_batches=1,
                      on_nonfinite="skip")

    def trainer():
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=td.tokenizer().get_vocab_size(), d_model=16, n_layers=1,
                                      n_heads=2, context_length=16, pattern="linear"))
        orig = m.forward
        m.forward = lambda idx, **kw: orig(idx, **kw) * (1.0 if m.training else float("nan"))   # held-out only
        return Trainer(m, td, cfg, tmp_path / "r", progress=False)
    t = trainer()
    t.fit(stop_at=2)
    t = trainer()
    assert t.resume() and t.step == 2 and math.isnan(t.curve[-1][1])
    result = t.fit()
    assert result["steps"] == 4
    _, _, meta = load_checkpoint(tmp_path / "r")
    assert meta["step"] == 4 and meta["curve"] == [[2, None], [4, None]]
    recs = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["heldout_loss"] is None


# -- resume: the run's own data, its checkpoints, its metrics -------------------------------------------


def test_changed_data_files_are_refused_on_resume_naming_what_changed(run, env, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(env[1], data)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "data": str(data)}))  # the run's data, at a new place
    (data / "a.py").write_text((data / "a.py").read_text() + "x = 1\n")
    (data / "c.py").write_text("def c(): pass\n")
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert resume(run, "--steps", "6") == 2
    out, err = capsys.readouterr()
    assert "the data differ" in err and "a.py changed" in err and "c.py added" in err
    assert "training a byte-level BPE" not in out                   # refused before any new tokenizer
    assert (run / "metrics.jsonl").read_bytes() == before
    assert cfg["corpus_sha256"] == json.loads((run / "manifest.json").read_text())["sha256"]
    assert len(cfg["tokenizer_sha256"]) == 64


def test_a_config_json_edited_by_hand_is_refused_against_the_checkpoints_training(run, capsys):
    """config.json says lr 0.01 and batch 3, the newest checkpoint trained with 0.003 and 2: a resume would
    follow config.json silently (the flags are compared with config.json, which agreed) - refused, naming both,
    nothing written; with config.json put back it resumes."""
    path = run / "config.json"
    good = path.read_text()
    cfg = json.loads(good)
    cfg["train"].update(lr=0.01, batch_size=3)
    path.write_text(json.dumps(cfg))
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert resume(run, "--steps", "6") == 2
    err = capsys.readouterr().err
    assert "differs from the training its newest checkpoint (step 4) holds" in err, err
    assert "lr: 0.01 (the checkpoint trained with 0.003)" in err
    assert "batch_size: 3 (the checkpoint trained with 2)" in err
    assert (run / "metrics.jsonl").read_bytes() == before and json.loads(path.read_text()) == cfg
    path.write_text(good)
    assert resume(run, "--steps", "6", "--pattern", "linear*1") == 0          # the run's 'linear', spelled otherwise
    assert steps_of(run) == [1, 2, 3, 4, 5, 6]


def test_a_run_another_process_trains_is_refused_by_its_lock(run, capsys):
    """While a process trains a run (here: holds its folder's lock, as train_run does - ranks a killed launcher
    left running did), a resume is refused by name and writes nothing; once the lock is gone it resumes. The
    lock is the folder's flock, held by another process here."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(60)", str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (run / "metrics.jsonl").read_bytes()
        capsys.readouterr()
        assert resume(run, "--steps", "6") == 2
        assert "another process is training the run in" in capsys.readouterr().err
        assert (run / "metrics.jsonl").read_bytes() == before
    finally:
        holder.kill()
        holder.wait(30)
    assert resume(run, "--steps", "6") == 0 and steps_of(run) == [1, 2, 3, 4, 5, 6]


def test_a_pattern_spelled_otherwise_is_the_same_run():
    """--pattern 'mamba2,mamba2,mamba2,softmax' on a run of 'mamba2*3,softmax' names the same stack: no
    difference (it was refused); another stack is still named."""
    from subquad.models import ModelConfig
    from subquad.train.run import resume_differences
    from subquad.train.trainer import TrainConfig

    saved_cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=4, n_heads=2, pattern="mamba2*3,softmax")
    saved = {"model": saved_cfg.to_dict(), "train": {**TrainConfig().__dict__}, "data": "stdlib"}
    same = ModelConfig(**{**saved_cfg.to_dict(), "pattern": "mamba2,mamba2,mamba2,softmax"})
    assert resume_differences(saved, same, TrainConfig(), None) == []
    other = ModelConfig(**{**saved_cfg.to_dict(), "pattern": "mamba2*2,softmax*2"})
    assert resume_differences(saved, other, TrainConfig(), None) == [
        "pattern: 'mamba2*2,softmax*2' (the run has 'mamba2*3,softmax')"]


def test_a_truncated_tokenizer_is_refused_by_its_hash(run, capsys):
    tok = run / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-200])
    capsys.readouterr()
    for cmd in (["train", "--out", str(run), "--resume", "--steps", "6", "--no-progress"],
                ["eval", "--run", str(run)], ["generate", "--run", str(run), "--prompt", "x"]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert "tokenizer.json is truncated or altered" in err and len(err.strip().splitlines()) == 1, err


def test_lost_checkpoints_are_refused_unless_restart(run, capsys):
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert resume(run, "--restart", "--steps", "4") == 2                # an intact checkpoint: --resume it
    assert "has step_0000004" in capsys.readouterr().err
    shutil.rmtree(run / "ckpt")
    assert resume(run, "--steps", "6") == 2
    err = capsys.readouterr().err
    assert "ckpt/ is missing or empty" in err and "--restart" in err
    (run / "ckpt").mkdir()
    assert resume(run, "--steps", "6") == 2
    assert (run / "metrics.jsonl").read_bytes() == before
    capsys.readouterr()
    assert main(["eval", "--run", str(run)]) == 2                   # not "no checkpoint yet": it had some
    assert "has no checkpoint: it wrote some, but ckpt/ is empty now" in capsys.readouterr().err
    assert resume(run, "--restart", "--steps", "2") == 0
    assert steps_of(run) == [1, 2] and find_checkpoint(run).name == "step_0000002"


def test_a_torn_line_of_the_checkpointed_step_is_rewritten_from_the_checkpoint(run, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:9])       # step 4's line torn
    assert resume(run, "--steps", "6") == 0
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6] and recs[3] == json.loads(lines[3])


# -- the learning-rate schedule on resume, and a run shorter than its warmup -----------------------------


def cosine(step, lr=3e-3, warmup=1, length=4):
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (length - warmup)))))


@pytest.mark.parametrize("flags, length, said", [((), 4, "keeps its length, 4 steps"),
                                                  (("--reschedule",), 8, "--reschedule: the cosine schedule now "
                                                                         "ends at step 8 (it ended at 4)")])
def test_growing_steps_keeps_the_schedule_unless_rescheduled(run, capsys, flags, length, said):
    capsys.readouterr()
    assert resume(run, "--steps", "8", *flags) == 0
    assert said in capsys.readouterr().out
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["lr"] for r in recs[4:]] == pytest.approx([cosine(s, length=length) for s in range(5, 9)], rel=1e-12)
    assert json.loads((run / "config.json").read_text())["train"]["schedule_steps"] == length


def test_a_run_from_before_schedule_steps_keeps_its_schedule(run):
    cfg = json.loads((run / "config.json").read_text())
    for key in ("checkpointed", "tokenizer_sha256", "corpus_sha256"):       # what such a run's config lacks
        cfg.pop(key, None)
    cfg["train"].pop("schedule_steps", None)
    (run / "config.json").write_text(json.dumps(cfg))
    assert resume(run, "--steps", "6") == 0
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["lr"] for r in recs[4:]] == pytest.approx([cosine(s, length=4) for s in (5, 6)], rel=1e-12)


def test_a_run_shorter_than_its_warmup_warns(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUBQUAD_CACHE", str(env[0] / "cache"))
    assert main(argv(env[1], tmp_path / "short", "--steps", "2", "--warmup", "10")) == 0
    warned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "10-step warmup" in warned[0] and "0.0006" in warned[0]


# -- help ------------------------------------------------------------------------------------------------


def test_generate_help_lists_every_checkpoint_type_and_true_defaults(capsys):
    from subquad.models.hf import MAPPINGS

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    out = out[out.index("options:"):]                           # the flags, not the usage line
    assert set(MAPPINGS) == {"mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "qwen3_next", "olmo_hybrid",
                             "kimi_linear", "minimax", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text",
                             "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "falcon_h1", "recurrent_gemma",
                             "rwkv7", "zamba2", "zamba", "lfm3", "bailing_hybrid", "xlstm", "qwen4_exp",
                             "qwen4_exp_text"}
    assert all(t in out for t in MAPPINGS)
    prompt = out[out.index("--prompt PROMPT"):out.index("--prompts-file PROMPTS_FILE")]
    assert "default" not in prompt and "required" in prompt
    assert "sampling seed (default: 0)" in out


def test_an_odd_context_trains_on_one_process(env, tmp_path, monkeypatch):
    """The zigzag layout's even split is context parallelism's; one process takes any --context (15 and 1 were
    refused with a message about the zigzag layout)."""
    monkeypatch.setenv("SUBQUAD_CACHE", str(env[0] / "cache"))
    for ctx in ("15", "1"):
        assert main(argv(env[1], tmp_path / ctx, "--steps", "1", "--context", ctx)) == 0
        assert json.loads((tmp_path / ctx / "config.json").read_text())["model"]["context_length"] == int(ctx)
