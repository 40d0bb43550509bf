"""The recall sweep follows Zoology's protocol: a short convolution in front of every attention-like mixer."""

from subquad.bench.recall import MIXERS, cell_model
from subquad.layers.conv import ShortConv


def test_every_fixed_state_mixer_of_the_sweep_has_a_short_convolution():
    for label, (pattern, options) in MIXERS.items():
        model = cell_model(pattern, options, vocab=32, d_model=32, T=16, mlp=False, seed=0)
        for block in model.blocks:
            mixer = block.mixer
            kind = type(mixer).__name__
            has_conv = any(isinstance(m, ShortConv) for m in mixer.modules())
            if kind == "SoftmaxAttention" or label.endswith("no conv)"):
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
    best = best_per_cell({"cells": {str(i): c for i, c in enumerate(cells)}})[("softmax", 64, 4, 64)]
    assert (best["lr"], best["seeds"], best["low"], best["high"]) == (1e-2, 2, 0.80, 0.90)
    cells.append(cell(3e-3, 1, 0.95))
    best = best_per_cell({"cells": {str(i): c for i, c in enumerate(cells)}})[("softmax", 64, 4, 64)]
    assert best["lr"] == 3e-3 and abs(best["accuracy"] - 0.97) < 1e-12
