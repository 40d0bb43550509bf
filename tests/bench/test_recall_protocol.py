"""The recall sweep follows Zoology's protocol: a short convolution in front of every attention-like mixer."""

import inspect

from subquad.bench.recall import MIXERS, cell_model, sweep_rows
from subquad.layers.attention import SoftmaxAttention
from subquad.layers.conv import ShortConv
from subquad.layers.registry import MIXERS as TABLE


def test_every_fixed_state_mixer_of_the_sweep_has_a_short_convolution():
    for label, (pattern, options) in sweep_rows().items():
        model = cell_model(pattern, options, vocab=32, d_model=32, T=16, mlp=False, seed=0)
        for block in model.blocks:
            mixer = block.mixer
            kind = type(mixer).__name__
            has_conv = any(isinstance(m, ShortConv) for m in mixer.modules())
            # attention keeps none, nor a layer without the option (lightning: MiniMax's layer has none)
            no_option = "conv_size" not in inspect.signature(type(mixer).__init__).parameters
            if isinstance(mixer, SoftmaxAttention) or label.endswith("no conv)") or no_option:
                assert not has_conv, (label, kind)      # the deviation stated in bench/recall.py; the controls
            else:
                assert has_conv, (label, kind)


def test_weight_decay_all_is_zoologys_and_matrices_spares_vectors():
    """One step with zero gradients: AdamW's decoupled decay alone moves the parameters, p <- p (1 - lr wd).
    "all" (Zoology's trainer) shrinks every parameter; "matrices" leaves norms, biases and Mamba-2's A_log,
    D, dt_bias (1-D) where they were and shrinks the matrices as "all" does."""
    import pytest
    import torch

    from subquad.bench.recall import optimizer

    lr = 0.5
    for decay in ("all", "matrices"):
        model = cell_model("mamba2,softmax", {}, vocab=32, d_model=32, T=16, mlp=False, seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = optimizer(model, lr, decay)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for n, p in model.named_parameters():
            shrunk = before[n] * (1 - lr * 0.1)
            spared = decay == "matrices" and p.dim() < 2
            torch.testing.assert_close(p.detach(), before[n] if spared else shrunk, msg=f"{decay}: {n}")
        names = [n for n, p in model.named_parameters() if p.dim() < 2]
        assert {"blocks.0.mixer.A_log", "blocks.0.mixer.D", "blocks.0.mixer.dt_bias"} <= set(names)
    with pytest.raises(ValueError, match="decay"):
        optimizer(model, lr, "none")


def test_a_decay_other_than_zoologys_is_a_row_of_its_own(tmp_path):
    from subquad.bench import recall

    kw = dict(mixers=["softmax"], sizes=[(16, 2)], d_models=[16], lrs=[3e-3], vocab=32, steps=2, batch=4,
              seeds=[0], progress=False, log=lambda m: None)
    recall.sweep(out=tmp_path, **kw)
    res = recall.sweep(out=tmp_path, decay="matrices", **kw)
    assert sorted(r["decay"] for r in res["cells"].values()) == ["all", "matrices"]
    rows = [line.split(" | ")[0] for line in recall.table(res).splitlines()[2:]]
    assert rows == ["| softmax", "| softmax [decay: matrices]"]


def test_the_best_learning_rate_is_chosen_among_complete_ones():
    """A learning rate with one seed run so far does not displace one with both, however good that seed."""
    from subquad.bench.recall import best_per_cell

    def cell(lr, seed, acc):
        return {"mixer": "softmax", "T": 64, "N": 4, "d_model": 64, "lr": lr, "vocab": 512, "seed": seed,
                "budget": 1500, "accuracy": acc, "steps": 1500, "state_bytes": 1}

    cells = [cell(1e-2, 0, 0.90), cell(1e-2, 1, 0.80), cell(3e-3, 0, 0.99)]
    best = best_per_cell({"cells": {str(i): c for i, c in enumerate(cells)}})[("softmax", 64, 4, 64, 1500)]
    assert (best["lr"], best["seeds"], best["low"], best["high"]) == (1e-2, 2, 0.80, 0.90)
    cells.append(cell(3e-3, 1, 0.95))
    best = best_per_cell({"cells": {str(i): c for i, c in enumerate(cells)}})[("softmax", 64, 4, 64, 1500)]
    assert best["lr"] == 3e-3 and abs(best["accuracy"] - 0.97) < 1e-12


def _cell(budget, acc, seed=0, mixer="softmax"):
    return {"mixer": mixer, "T": 16, "N": 2, "d_model": 16, "lr": 3e-3, "vocab": 32, "mlp": False, "seed": seed,
            "budget": budget, "decay": "all", "accuracy": acc, "steps": budget, "seconds": 0.0, "state_bytes": 64,
            "parameters": 1}


def test_the_recall_table_shows_its_step_budget_and_keys_cells_by_it():
    """Two budgets of one cell are two rows, each with its own accuracy - never pooled, never one best of both."""
    from subquad.bench import recall

    cells = [_cell(100, 0.30), _cell(100, 0.50, seed=1), _cell(1500, 0.99), _cell(1500, 0.97, seed=1)]
    res = {"cells": {str(i): c for i, c in enumerate(cells)}}
    best = recall.best_per_cell(res)
    assert sorted(best) == [("softmax", 16, 2, 16, 100), ("softmax", 16, 2, 16, 1500)]
    assert best["softmax", 16, 2, 16, 100]["accuracy"] == 0.40 and best["softmax", 16, 2, 16, 1500]["high"] == 0.99
    lines = recall.table(res, mix_budgets=True).splitlines()
    assert lines[0].startswith("| mixer | budget (steps) | T=16, N=2, d=16 |")
    assert lines[2:] == ["| softmax | 100 | 0.40 (0.30-0.50) @3e-3† | 64 |",
                         "| softmax | 1,500 | 0.98 (0.97-0.99) @3e-3† | 64 |"]
    one = {"cells": {str(i): c for i, c in enumerate(cells[2:])}}
    assert recall.table(one).splitlines()[2] == "| softmax | 1,500 | 0.98 (0.97-0.99) @3e-3† | 64 |"


def test_a_cell_names_its_best_learning_rate_and_marks_one_run_alone(tmp_path):
    """``@lr`` is the learning rate whose seeds' mean is best; ``†`` goes once a second learning rate has run,
    whichever wins. The heat map draws the same cells."""
    from subquad.bench import recall

    cells = [_cell(1500, 0.50), _cell(1500, 0.70, seed=1)]
    res = {"cells": {str(i): c for i, c in enumerate(cells)}}
    assert recall.table(res).splitlines()[2] == "| softmax | 1,500 | 0.60 (0.50-0.70) @3e-3† | 64 |"
    cells += [dict(_cell(1500, 0.90), lr=1e-2), dict(_cell(1500, 0.80, seed=1), lr=1e-2)]
    res = {"cells": {str(i): c for i, c in enumerate(cells)}}
    assert recall.table(res).splitlines()[2] == "| softmax | 1,500 | 0.85 (0.80-0.90) @1e-2 | 64 |"
    assert recall.best_per_cell(res)["softmax", 16, 2, 16, 1500]["lrs"] == 2
    recall.grid(res, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_one_recall_table_refuses_to_mix_step_budgets_unless_asked(tmp_path, monkeypatch):
    """A rerun into the same folder with another --steps is refused before it trains anything; asked to mix,
    it runs, and then the table and the plot refuse the mixed results unless they are asked too."""
    import json

    import pytest

    from subquad.bench import recall

    trained = []

    def train_cell(pattern, options, *, steps, seed, **kw):          # the sweep's bookkeeping, not training
        trained.append(steps)
        return {"accuracy": 0.5, "steps": steps, "seconds": 0.0, "state_bytes": 64, "parameters": 1}

    monkeypatch.setattr(recall, "train_cell", train_cell)
    kw = dict(mixers=["softmax"], sizes=[(16, 2)], d_models=[16], lrs=[3e-3], vocab=32, batch=4, seeds=[0],
              progress=False, log=lambda m: None)
    recall.sweep(out=tmp_path, steps=100, **kw)
    before = (tmp_path / "recall.json").read_text()
    with pytest.raises(ValueError, match=r"budget of 100 steps; this sweep asks for 1,500 steps"):
        recall.sweep(out=tmp_path, steps=1500, **kw)
    assert trained == [100] and (tmp_path / "recall.json").read_text() == before
    assert recall.sweep(out=tmp_path, steps=100, **kw)["cells"] == json.loads(before)["cells"]   # same budget: resumes

    res = recall.sweep(out=tmp_path, steps=1500, mix_budgets=True, **kw)
    assert trained == [100, 1500] and recall.budgets(res) == {100, 1500}
    with pytest.raises(ValueError, match=r"mix step budgets \(100 steps and 1,500 steps\)"):
        recall.table(res)
    with pytest.raises(ValueError, match="mix step budgets"):
        recall.plot(res, tmp_path / "recall.png")
    assert [line.split(" | ")[1] for line in recall.table(res, mix_budgets=True).splitlines()[2:]] == ["100", "1,500"]
    with pytest.raises(ValueError, match="mix step budgets"):
        recall.grid(res, tmp_path / "grid.png")
    recall.plot(res, tmp_path / "recall.png", mix_budgets=True)
    recall.grid(res, tmp_path / "grid.png", mix_budgets=True)
    assert (tmp_path / "recall.png").stat().st_size > 0 and (tmp_path / "grid.png").stat().st_size > 0


def test_every_mechanism_of_the_table_is_a_row_of_the_sweep():
    """Every causal one: the sweep trains language models, which an encoder-only mixer cannot be."""
    rows = sweep_rows()
    singles = {pattern for pattern, _ in rows.values()}
    assert {n for n, e in TABLE.items() if not e.encoder_only} <= singles
    assert not {n for n, e in TABLE.items() if e.encoder_only} & singles
    assert list(rows)[:len(MIXERS)] == list(MIXERS)          # the published labels first, unchanged
