import json
import shutil

import pytest
import torch

from subquad.cli import build_parser, main


def test_memory_command_prints_plate_numbers(capsys):
    assert main(["memory", "--context", "1024,131072", "--measure-max", "1024", "--flops"]) == 0
    out = capsys.readouterr().out
    assert "8,388,608" in out and "1,056" in out and "N²d" in out


def test_workshop_writes_png_and_json(tmp_path, capsys):
    assert main(["workshop", "--out", str(tmp_path), "--no-train"]) == 0
    res = json.loads((tmp_path / "workshop.json").read_text())
    assert res["parallel_vs_recurrent_max_abs_diff"] < 1e-14
    assert (tmp_path / "workshop.png").stat().st_size > 10_000
    assert "max |parallel - recurrent|" in capsys.readouterr().out


def test_workshop_second_half_trains_both_runs_and_reports_the_gap(tmp_path, capsys, corpus, brief_evals):
    # 2 steps: a curve of two points per run; each step of micro's shape also measures the held-out loss (one
    # batch here: brief_evals) and saves a checkpoint, for 2 mixers x 2 seeds
    out = tmp_path / "ws"
    assert main(["workshop", "--out", str(out), "--steps", "2", "--seeds", "2", "--data", str(corpus),
                 "--no-progress"]) == 0
    res = json.loads((out / "workshop.json").read_text())["training"]
    assert len(res["final"]["softmax"]) == len(res["final"]["linear"]) == 2
    assert res["gap_std"] is not None and abs(res["gap_mean"] - sum(res["gaps"]) / 2) < 1e-12
    assert [len(c) for c in res["curves"]["linear"]] == [2, 2]
    assert "gap" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["memory", "--context", "abc"], ["memory", "--context", "0"],
                                  ["memory", "--head-dim", "-1"], ["memory", "--dtype", "int8"], ["nope"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_train_eval_generate_end_to_end(tmp_path, capsys, corpus, monkeypatch):
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--context", "32", "--pattern", "linear,softmax", "--steps", "4", "--batch-size", "2",
            "--eval-every", "2", "--ckpt-every", "2", "--out", str(run), "--no-progress"]
    assert main(argv) == 0
    assert "held-out loss" in capsys.readouterr().out
    assert main(argv) == 2                                   # refuses to overwrite a run without --resume
    assert "--resume" in capsys.readouterr().err
    assert main(argv[:-3] + ["--out", str(run), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert main(["eval", "--run", str(run), "--batches", "2", "--batch-size", "2"]) == 0
    assert "step 6" in capsys.readouterr().out
    st = tmp_path / "state.safetensors"
    assert main(["generate", "--run", str(run), "--prompt", "def h1", "--max-new-tokens", "5",
                 "--save-state", str(st)]) == 0
    err = capsys.readouterr().err
    from safetensors import safe_open

    with safe_open(str(st), framework="pt") as f:           # the printed size is what was saved: a KV cache's
        saved = sum(f.get_tensor(k).nbytes for k in f.keys())   # spare room is not state
    assert f"[state: {saved:,} bytes" in err
    assert main(["generate", "--run", str(run), "--load-state", str(st), "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--load-state", str(st), "--prompt", " zq", "--max-new-tokens",
                 "2"]) == 0
    assert capsys.readouterr().out.startswith(" zq")     # the appended text is printed before what follows it
    assert main(["generate", "--run", str(run), "--prompt", "def", "--save-state", str(tmp_path / "no" / "s")]) == 2
    assert "--save-state" in capsys.readouterr().err
    # a prompt read and saved with nothing generated, continued later: the run it interrupts (the saved state stops
    # before the prompt's last token, which the continuation feeds; it was fed twice)
    from subquad.models import load_state

    greedy = ["--max-new-tokens", "6", "--temperature", "0"]
    one = tmp_path / "one.safetensors"
    for n, path in (("1", one), ("0", st)):
        assert main(["generate", "--run", str(run), "--prompt", "def h1", "--max-new-tokens", n, "--save-state",
                     str(path), "--temperature", "0"]) == 0
    capsys.readouterr()
    (a, _), (b, _) = load_state(one), load_state(st)     # after the whole prompt; before its last token
    assert int(torch.as_tensor(b.pos).max()) == int(torch.as_tensor(a.pos).max()) - 1
    assert main(["generate", "--run", str(run), "--load-state", str(st), *greedy]) == 0
    later = capsys.readouterr().out
    assert main(["generate", "--run", str(run), "--prompt", "def h1", *greedy]) == 0
    assert capsys.readouterr().out == "def h1" + later
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def h1\n\ndef h22(z):\n")
    assert main(["generate", "--run", str(run), "--prompts-file", str(prompts), "--max-new-tokens", "4",
                 "--temperature", "0", "--stop", "\\n"]) == 0
    out = capsys.readouterr().out
    assert "--- [line 1] def h1" in out and "--- [line 3] def h22(z):" in out      # by line, the blank one skipped
    assert main(["generate", "--run", str(run), "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--run", str(run), "--prompt", ""]) == 2          # given, but empty: said so
    assert "--prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    from subquad.cli.common import load_model                # --dtype casts a run's weights, as a folder's
    args = build_parser().parse_args(["generate", "--run", str(run), "--dtype", "bfloat16"])
    assert {p.dtype for p in load_model(args)[0].parameters()} == {torch.bfloat16}
    assert main(["generate", "--run", str(run), "--dtype", "bfloat16", "--quantize", "int8"]) == 2
    assert "--dtype and --quantize" in capsys.readouterr().err
    import subquad.train as train                              # eval's held-out loss of the run in bfloat16 too
    seen = []
    real = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda model, *a, **k: seen.append(model.embed.weight.dtype) or
                        real(model, *a, **k))
    assert main(["eval", "--run", str(run), "--batches", "1", "--batch-size", "2", "--dtype", "bfloat16"]) == 0
    assert seen == [torch.bfloat16]


def test_train_refuses_bad_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--mixer-option", "window128"])
    assert main(["train", "--pattern", "softmax*3", "--no-progress"]) == 2
    assert "describes 3 layers" in capsys.readouterr().err
    assert main(["train", "--pattern", "swa", "--mixer-option", "swa.window=128", "--mixer-option",
                 "swa.window=64", "--no-progress"]) == 2
    assert "--mixer-option swa.window is given twice (128 and 64)" in capsys.readouterr().err
    assert main(["train", "--pattern", "mamba2", "--n-kv-heads", "2", "--no-progress"]) == 2   # would change nothing
    assert "--n-kv-heads sets the key/value heads of attention layers" in capsys.readouterr().err
    for value in ("0", "-5", "nan", "inf"):                # torch.distributed's timeout: refused before any rank
        with pytest.raises(SystemExit):
            main(["train", "--dist-timeout", value])
        assert f"--dist-timeout: expected a number of seconds > 0, got '{value}'" in capsys.readouterr().err


def test_quick_recall_sweep_runs_end_to_end_and_resumes(tmp_path, capsys):
    out = tmp_path / "recall"
    assert main(["recall", "--quick", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "recall.json").read_text())
    assert len(res["cells"]) == 4                                       # 2 mixers x 2 seeds
    assert all(0 <= c["accuracy"] <= 1 and c["state_bytes"] > 0 for c in res["cells"].values())
    assert sorted(c["seed"] for c in res["cells"].values()) == [0, 0, 1, 1]
    md = (out / "recall.md").read_text()
    assert (out / "recall.png").exists() and (out / "recall_grid.png").exists() and "softmax" in md and "-" in md.splitlines()[2]   # mean (low-high)
    capsys.readouterr()
    assert main(["recall", "--quick", "--out", str(out), "--no-progress"]) == 0     # resumes: nothing left to run
    assert "[1/4]" not in capsys.readouterr().out
    assert main(["recall", "--quick", "--sizes", "16x2", "--out", str(out)]) == 2   # not silently ignored
    assert "--quick sets its own tiny sweep; drop --sizes" in capsys.readouterr().err
    for flag, value in (("--lrs", "0"), ("--d-models", "0,32"), ("--lrs", "x"), ("--sizes", "64x40"),
                        ("--sizes", "63x4"), ("--sizes", "64x0")):    # MQAR's conditions: before any cell trains
        with pytest.raises(SystemExit):
            main(["recall", flag, value])
        assert flag in capsys.readouterr().err
    assert main(["recall", "--sizes", "64x4", "--vocab", "32", "--out", str(tmp_path / "v")]) == 2
    assert "--sizes 64x4: MQAR needs --vocab (32) above each length T" in capsys.readouterr().err


def test_recall_sweep_is_budgeted_in_steps_not_seconds(tmp_path, monkeypatch):
    """A machine 1,000x slower (every clock read jumps 1,000 s) gets the same cells, steps and accuracies."""
    from subquad.bench import recall

    kw = dict(mixers=["softmax", "gla"], sizes=[(16, 2)], d_models=[32], lrs=[3e-3], vocab=32, steps=60, batch=16,
              seeds=[0], progress=False, log=lambda m: None)
    fast = recall.sweep(out=tmp_path / "fast", **kw)
    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(recall.time, "time", lambda: float(next(clock)))
    slow = recall.sweep(out=tmp_path / "slow", **kw)
    strip = lambda res: {k: (c["accuracy"], c["steps"]) for k, c in res["cells"].items()}   # noqa: E731
    assert strip(fast) == strip(slow) and all(c["steps"] == 60 or c["accuracy"] >= 0.99 for c in slow["cells"].values())


def test_train_context_parallel_launches_two_processes(tmp_path, capsys, corpus):
    run = tmp_path / "cp"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--context", "32", "--pattern", "mamba2,softmax", "--steps", "2",
                 "--batch-size", "2", "--eval-every", "2", "--ckpt-every", "2", "--out", str(run), "--no-progress",
                 "--context-parallel", "2"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world"] == 2 and cfg["train"]["context_parallel"] == 2
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and "heldout_loss" in lines[-1]
    # it continues on one process (context parallelism is the layout, not the math: the same 2 sequences a step),
    # as a run trained on one process from the start does
    one = tmp_path / "one"
    argv = ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2", "--n-heads",
            "2", "--context", "32", "--pattern", "mamba2,softmax", "--batch-size", "2", "--eval-every", "2",
            "--ckpt-every", "2", "--no-progress"]
    assert main(argv + ["--steps", "2", "--out", str(one)]) == 0
    shutil.copytree(one, tmp_path / "later")          # ... and a one-process run continues on a group of two
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--steps", "4", "--context-parallel", "1",
                 "--no-progress"]) == 0
    assert ("the run trained on 2 processes, context-parallel 2; it continues on 1 process: the same 2 sequences a "
            "step") in capsys.readouterr().out
    assert main(["train", "--resume", "--out", str(tmp_path / "later"), "--steps", "4", "--context-parallel", "2",
                 "--no-progress"]) == 0                 # both ranks continue the run's one stream of batches
    assert main(["train", "--resume", "--out", str(one), "--steps", "4", "--no-progress"]) == 0
    cp, later, alone = ([json.loads(ln) for ln in (r / "metrics.jsonl").read_text().splitlines()]
                        for r in (run, tmp_path / "later", one))
    assert [r["step"] for r in cp] == [r["step"] for r in later] == [1, 2, 3, 4]
    for a, b, c in zip(cp, later, alone, strict=True):
        assert a["loss"] == pytest.approx(c["loss"], abs=2e-5) and a["lr"] == c["lr"]
        assert b["loss"] == pytest.approx(c["loss"], abs=2e-5) and b["lr"] == c["lr"]


def test_train_refuses_nproc_not_a_multiple_of_context_parallel(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--pattern", "linear", "--n-layers", "2", "--nproc", "3", "--context-parallel", "2",
              "--no-progress"])
    assert "multiple of --context-parallel" in str(e.value.code)


@pytest.mark.parametrize("pattern", ["deltanet,mamba", "linear,performer", "taylor,gated_deltanet"])
def test_train_bf16_runs_the_mixers_that_used_to_crash(tmp_path, capsys, corpus, pattern):
    """`subquad train --bf16` (autocast) trains, evaluates and checkpoints finite weights for six mixers
    that crashed before autocast was handled at the op boundary."""
    run = tmp_path / "bf16"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--context", "32", "--pattern", pattern, "--steps", "3", "--batch-size", "2",
                 "--eval-every", "3", "--ckpt-every", "3", "--out", str(run), "--no-progress", "--bf16",
                 "--device", "cpu"]) == 0
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[-1]["heldout_loss"] < 10
    from subquad.train import load_run

    model, _, meta = load_run(run)
    assert meta["step"] == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_device_flag_refuses_what_is_not_there(capsys):
    from subquad.device import resolve_device

    assert resolve_device("cpu").type == "cpu" and resolve_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
        with pytest.raises(SystemExit) as e:
            main(["train", "--device", "cuda", "--no-progress"])
        assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_train_with_a_mixture_of_experts_and_resume_refuses_another(tmp_path, capsys, corpus):
    run = tmp_path / "moe"
    argv = ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--context", "32", "--pattern", "mamba", "--steps", "3", "--batch-size", "2",
            "--eval-every", "3", "--ckpt-every", "3", "--out", str(run), "--no-progress",
            "--moe", "experts=4,top_k=1,every=2,offset=1"]
    assert main(argv) == 0
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("aux_loss" in r for r in lines)
    from subquad.models.moe import MoE
    from subquad.train import load_run

    model, _, _ = load_run(run)
    assert model.config.moe["experts"] == 4 and isinstance(model.blocks[1].mlp, MoE)
    assert main(argv[:-1] + ["experts=8,top_k=1,every=2,offset=1", "--resume", "--steps", "4"]) == 2
    assert "moe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--moe", "experts"])


def test_memory_header_names_the_contexts_it_measured(capsys):
    # every context past --measure-max: the shortest is measured, and the header says so (issue 32)
    assert main(["memory", "--context", "2048,4096", "--measure-max", "1024", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "one head), T = 2,048:" in out and "T <= 1,024" not in out


def test_recall_rerun_with_another_budget_is_refused_unless_mixed(tmp_path, capsys):
    out = tmp_path / "recall"
    tiny = ["recall", "--out", str(out), "--mixers", "softmax", "--sizes", "16x2", "--d-models", "16", "--lrs",
            "3e-3", "--seeds", "1", "--vocab", "32", "--batch-size", "4", "--no-progress"]
    assert main(tiny + ["--steps", "2"]) == 0
    assert main(tiny + ["--steps", "3"]) == 2
    assert "budget of 2 steps; this sweep asks for 3 steps" in capsys.readouterr().err
    assert main(tiny + ["--steps", "3", "--mix-budgets"]) == 0
    rows = (out / "recall.md").read_text().splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["2", "3"]
