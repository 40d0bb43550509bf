"""Runs and checkpoints that cannot go wrong: resume reads the run's own settings and refuses changes,
the metrics history is exactly the checkpoint's steps in strict JSON, the newest intact checkpoint is
found by scanning, meta is checksummed, non-finite steps never update or save, and a failed start
leaves nothing behind."""

import json

import pytest
import torch

from subquad.cli import main
from subquad.models import LanguageModel, ModelConfig
from subquad.train import CheckpointError, TrainConfig, Trainer, TrainingDiverged, load_checkpoint
from subquad.train.checkpoint import find_checkpoint, save_checkpoint, verify_checkpoint
from subquad.train.trainer import _is_comm_failure, read_metrics


def train_argv(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--context", "32", "--pattern", "linear,softmax", "--batch-size", "2",
            "--eval-every", "2", "--ckpt-every", "2", "--out", str(out), "--no-progress", *extra]


def strict_lines(path):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return [json.loads(ln, parse_constant=refuse) for ln in path.read_text().splitlines()]


def test_resume_reads_the_runs_own_settings_and_refuses_changes(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train_argv(corpus, run, "--steps", "2")) == 0
    config = (run / "config.json").read_bytes()
    metrics = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    for flags, named in ((["--pattern", "softmax"], "pattern"), (["--d-model", "64"], "d_model"),
                         (["--lr", "0.1"], "lr"), (["--data", str(tmp_path / "other.txt")], "data")):
        assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", *flags]) == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err
        assert (run / "config.json").read_bytes() == config and (run / "metrics.jsonl").read_bytes() == metrics
    assert main(["train", "--out", str(run), "--resume", "--steps", "2", "--no-progress"]) == 2
    assert "at step 2 already" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    # no model flags repeated: the run's own settings, more steps allowed
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["steps"] == 4 and cfg["model"]["pattern"] == "linear,softmax"
    assert [r["step"] for r in strict_lines(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume", "--no-progress"]) == 2
    assert "holds no run" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


def test_bad_mixer_options_are_one_line_errors_and_leave_no_folder(tmp_path, corpus, capsys):
    out = tmp_path / "bad"
    assert main(train_argv(corpus, out, "--steps", "2", "--mixer-option", "softmax.windw=16")) == 2
    assert "has no option 'windw'" in capsys.readouterr().err
    assert main(train_argv(corpus, out, "--steps", "2", "--mixer-option", "swa.window=16")) == 2
    assert "not in the pattern" in capsys.readouterr().err
    assert main(train_argv(corpus, out, "--steps", "2", "--mixer-option", "softmax.window=\"x\"")) == 2
    assert "window must be a non-negative int" in capsys.readouterr().err
    assert not out.exists()
    from subquad.cli.train import _option

    assert [_option(f"swa.window={v}")[2] for v in ("None", "null", "16", "True", "false", "x")] == \
        [None, None, 16, True, False, "x"]                            # Python's spellings as JSON's


def test_a_run_that_fails_before_training_leaves_no_folder(tmp_path, corpus, monkeypatch):
    from subquad.train import run as run_module

    def broken(*a, **k):
        raise RuntimeError("the trainer could not start")
    monkeypatch.setattr(run_module, "Trainer", broken)
    with pytest.raises(RuntimeError, match="could not start"):
        main(train_argv(corpus, tmp_path / "half", "--steps", "2"))
    assert not (tmp_path / "half").exists()


def test_an_unwritable_output_folder_is_one_line(tmp_path, corpus, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert main(train_argv(corpus, blocker / "run", "--steps", "2")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the run") and len(err.strip().splitlines()) == 1


# -- the trainer directly ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from subquad.data import prepare

    root = tmp_path_factory.mktemp("corpus")
    (root / "code.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    return prepare(str(root / "code.py"), vocab_size=300, cache_dir=root / "cache", log=lambda m: None)


def model():
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, context_length=32,
                                     pattern="linear"))


CFG = dict(steps=8, batch_size=2, lr=3e-3, warmup=2, eval_every=4, eval_batches=2, ckpt_every=2, seed=0)


def trainer(path, **kw):
    return Trainer(model(), data_fixture[0], TrainConfig(**{**CFG, **kw}), path, progress=False)


data_fixture = []


@pytest.fixture(autouse=True)
def _data(data):
    data_fixture[:] = [data]


def test_a_kill_before_the_first_checkpoint_leaves_no_duplicate_steps(tmp_path):
    trainer(tmp_path / "r", ckpt_every=100).fit(stop_at=3)          # killed before any checkpoint
    t = trainer(tmp_path / "r", ckpt_every=100)
    assert not t.resume()                                            # nothing to resume: a fresh start
    t.fit()
    assert [r["step"] for r in strict_lines(tmp_path / "r" / "metrics.jsonl")] == list(range(1, 9))


def test_a_torn_last_line_is_dropped_and_the_history_matches_the_checkpoint(tmp_path):
    trainer(tmp_path / "r").fit(stop_at=5)                           # checkpoint at 4, lines 1..5
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')                                   # a kill while writing
    t = trainer(tmp_path / "r")
    assert t.resume() and t.step == 4
    assert [r["step"] for r in strict_lines(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3, 4]
    t.fit()
    assert [r["step"] for r in strict_lines(tmp_path / "r" / "metrics.jsonl")] == list(range(1, 9))
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path / "r" / "metrics.jsonl")


def test_the_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    trainer(tmp_path / "r").fit(stop_at=5)
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    import subquad.train.checkpoint as ck

    def killed(*a):
        raise KeyboardInterrupt("killed while replacing")
    monkeypatch.setattr(ck.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path / "r").resume()
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before  # intact: the new text went to a .tmp


def test_the_newest_intact_checkpoint_is_found_when_latest_is_lost_or_broken(tmp_path):
    run = tmp_path / "r"
    trainer(run).fit(stop_at=6)                                      # checkpoints at 4 and 6 kept
    (run / "ckpt" / "latest").unlink()
    said = []
    assert find_checkpoint(run, said.append).name == "step_0000006" and "missing" in said[0]
    (run / "ckpt" / "latest").write_text("step_0000099\n")           # dangling
    assert find_checkpoint(run, said.append).name == "step_0000006" and "does not exist" in said[-1]
    (run / "ckpt" / "latest").write_text("step_0000006\n")
    f = run / "ckpt" / "step_0000006" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])                              # the newest is corrupted
    _, _, meta = load_checkpoint(run, said.append)
    assert meta["step"] == 4 and "truncated or corrupted" in said[-1]
    t = trainer(run)
    assert t.resume() and t.step == 4
    t.fit()                                                          # new checkpoints (6, 8) survive pruning
    assert find_checkpoint(run).name == "step_0000008"


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    for step in (10, 20):
        save_checkpoint(tmp_path, step, m, opt, {})
    path = save_checkpoint(tmp_path, 5, m, opt, {}, keep=2)
    assert path.exists() and (tmp_path / "ckpt" / "latest").read_text().strip() == "step_0000005"



def test_a_symlinked_step_folder_is_reported_and_never_followed(tmp_path):
    """ckpt/step_* that is a symlink (into another run, here a newer and intact step) is not this run's
    checkpoint: resume takes the newest real folder and says why, latest naming it is not followed, loading it
    by name is refused, and pruning leaves the folder it points to alone."""
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    other = save_checkpoint(tmp_path / "other", 10, m, opt, {})
    run = tmp_path / "r"
    save_checkpoint(run, 4, m, opt, {})
    link = run / "ckpt" / "step_0000010"
    link.symlink_to(other, target_is_directory=True)
    said = []
    assert find_checkpoint(run, said.append).name == "step_0000004" and "symlink" in said[-1]
    (run / "ckpt" / "latest").write_text("step_0000010\n")
    assert find_checkpoint(run, said.append).name == "step_0000004" and "symlink" in said[-1]
    assert load_checkpoint(run)[2]["step"] == 4
    with pytest.raises(CheckpointError, match="step_0000010 is a symlink"):
        load_checkpoint(link)
    save_checkpoint(run, 6, m, opt, {}, keep=1)                      # prunes step 4, not the link's target
    assert not (run / "ckpt" / "step_0000004").exists() and verify_checkpoint(other)
    only = tmp_path / "only" / "ckpt"
    only.mkdir(parents=True)
    (only / "step_0000010").symlink_to(other, target_is_directory=True)
    with pytest.raises(CheckpointError, match="step_0000010 is a symlink"):
        find_checkpoint(only.parent)

def test_meta_is_covered_by_the_checksum(tmp_path):
    run = tmp_path / "r"
    trainer(run, steps=2).fit()
    meta_path = run / "ckpt" / "step_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "step": 1}))
    with pytest.raises(CheckpointError, match="altered"):
        load_checkpoint(run / "ckpt" / "step_0000002")
    del meta["sha256"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="no checksums"):
        load_checkpoint(run / "ckpt" / "step_0000002")


def poison_gradients(m, after_step, t):
    """A finite loss whose gradient is NaN once the trainer passes ``after_step``."""
    p = next(m.parameters())
    p.register_hook(lambda g: g * float("nan") if t[0].step >= after_step else g)


def test_a_non_finite_gradient_stops_before_updating_and_is_never_saved(tmp_path):
    t = trainer(tmp_path / "r")
    poison_gradients(t.model, 4, [t])
    with pytest.raises(TrainingDiverged, match="gradient norm became nan at step 5"):
        t.fit()
    assert all(torch.isfinite(p).all() for p in t.model.parameters())   # no update from step 5
    _, _, meta = load_checkpoint(tmp_path / "r")
    assert meta["step"] == 4


def test_skipping_non_finite_steps_keeps_training_and_logs_strict_json(tmp_path):
    t = trainer(tmp_path / "r", on_nonfinite="skip")
    poison_gradients(t.model, 4, [t])
    orig = t.model.forward
    t.model.forward = lambda idx, **kw: orig(idx, **kw) * (float("nan") if t.step == 6 else 1.0)   # step 7: NaN loss
    assert t.fit()["skipped_steps"] == 4                          # counted for the command's last line
    lines = strict_lines(tmp_path / "r" / "metrics.jsonl")
    assert [r.get("skipped", False) for r in lines] == [False] * 4 + [True] * 4
    assert lines[6]["loss"] is None                                # NaN written as null: strict JSON
    model_sd, _, meta = load_checkpoint(tmp_path / "r")
    assert meta["step"] == 8 and all(torch.isfinite(v).all() for v in model_sd.values())


def test_only_communication_failures_are_reported_as_a_lost_peer():
    assert _is_comm_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert _is_comm_failure(RuntimeError("Timed out waiting 60000ms for recv operation to complete"))
    assert not _is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not _is_comm_failure(RuntimeError("expected scalar type Float but found Double"))


def test_eval_reports_the_trainers_held_out_loss(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train_argv(corpus, run, "--steps", "4")) == 0
    held = [r["heldout_loss"] for r in strict_lines(run / "metrics.jsonl") if "heldout_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"held-out loss {held:.4f}" in out, (held, out)
    assert main(["eval", "--run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("subquad ")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "gated_deltanet" in out and "jamba" in out and "(default: 600)" in out


def test_recall_mixer_labels_with_commas_are_selectable():
    from subquad.bench.recall import sweep_rows
    from subquad.cli.recall import mixer_list as _mixer_list

    assert _mixer_list("softmax, hybrid (mamba2, softmax),linear (elu+1)") == [
        "softmax", "hybrid (mamba2, softmax)", "linear (elu+1)"]
    assert all(_mixer_list(label) == [label] for label in sweep_rows())


def test_a_run_with_a_relative_data_path_resumes_from_anywhere(tmp_path, corpus, capsys, monkeypatch):
    """--data as typed (relative) is recorded absolute: the run resumes from another directory without it, and
    with it named another way (a relative path from there); another file is still refused."""
    monkeypatch.chdir(corpus.parent)
    run = tmp_path / "run"
    assert main(train_argv(corpus.name, run, "--steps", "2")) == 0
    assert json.loads((run / "config.json").read_text())["data"] == str(corpus.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", "--data",
                 f"../{corpus.name}"]) == 0
    (tmp_path / "other.txt").write_text("x = 1\n" * 50)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "5", "--no-progress", "--data",
                 "../other.txt"]) == 2
    assert "data" in capsys.readouterr().err


def test_a_checkpoint_of_another_model_in_the_run_is_named(tmp_path, corpus, capsys):
    """Another run's newer checkpoint copied into a run: --resume refuses it in one line naming the config fields
    that differ; eval uses the checkpoint's own config and says so."""
    import shutil

    run, other = tmp_path / "run", tmp_path / "other"
    assert main(train_argv(corpus, run, "--steps", "2")) == 0
    assert main(train_argv(corpus, other, "--steps", "4", "--d-model", "48")) == 0
    shutil.copytree(other / "ckpt" / "step_0000004", run / "ckpt" / "step_0000004")
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds another model" in err and "d_model 48 (the run's 32)" in err
    assert main(["eval", "--run", str(run)]) == 0
    assert "another config than" in capsys.readouterr().err


def test_resume_reads_mixer_options_against_the_runs_pattern(tmp_path, corpus, capsys):
    """--resume --mixer-option: the run's own options continue it; another value is refused as a change (not
    as a mixer missing from the default preset's pattern)."""
    run = tmp_path / "run"
    argv = train_argv(corpus, run, "--steps", "2")
    argv[argv.index("linear,softmax")] = "linear,swa"
    assert main(argv + ["--mixer-option", "swa.window=16"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress", "--mixer-option",
                 "swa.window=16"]) == 0
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", "--mixer-option",
                 "swa.window=8"]) == 2
    err = capsys.readouterr().err
    assert "would change it" in err and "mixer_options" in err and "not in the pattern" not in err


def test_the_command_warns_of_skipped_steps(tmp_path, corpus, capsys):
    assert main(train_argv(corpus, tmp_path / "run", "--steps", "3", "--lr", "1e30", "--on-nonfinite", "skip")) == 0
    out = capsys.readouterr().out
    assert "warning: " in out and "steps were skipped (a non-finite loss or gradient" in out

