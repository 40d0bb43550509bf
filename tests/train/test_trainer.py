"""A tiny seeded run equals the same steps written by hand; resume continues the same curve; bad checkpoints fail clearly."""

import json

import pytest
import torch

from subquad.data import prepare
from subquad.models import LanguageModel, ModelConfig
from subquad.train import CheckpointError, TrainConfig, Trainer, TrainingDiverged, load_checkpoint

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "code.py").write_text(TEXT)
    return prepare(str(root / "code.py"), vocab_size=300, cache_dir=root / "cache", log=lambda m: None)


def model(pattern="linear"):
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, context_length=32,
                                     pattern=pattern))


def losses(run_dir):
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


CFG = dict(steps=12, batch_size=4, lr=3e-3, warmup=2, eval_every=6, eval_batches=2, ckpt_every=6, seed=0)


def reference_losses(data, steps):
    """The same run written out by hand: the same initial weights and batches, AdamW with betas (0.9, 0.95)
    and weight decay on matrices only, linear warmup then cosine to 10%, clipping at norm 1."""
    import math

    import torch.nn.functional as F

    m = model()
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=CFG["lr"], betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(CFG["seed"])
    T, B, tokens = 32, CFG["batch_size"], data.train
    out = []
    for step in range(1, steps + 1):
        w = CFG["warmup"]
        frac = (step - w) / (CFG["steps"] - w)
        lr = CFG["lr"] * (step / w if step <= w else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=gen).tolist()
        win = torch.stack([torch.as_tensor(tokens[s:s + T + 1].astype("int64")) for s in starts])
        loss = F.cross_entropy(m(win[:, :-1]).reshape(-1, 300), win[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CFG["grad_clip"] if "grad_clip" in CFG else 1.0)
        opt.step()
        out.append(loss.item())
    return out


def test_seeded_run_is_reproducible_and_matches_a_hand_written_reference(data, tmp_path):
    Trainer(model(), data, TrainConfig(**CFG), tmp_path / "a", progress=False).fit()
    Trainer(model(), data, TrainConfig(**CFG), tmp_path / "b", progress=False).fit()
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la == lb and len(la) == 12
    assert la[-1] < la[0]
    assert la == pytest.approx(reference_losses(data, 12), abs=2e-5)     # metrics round to 5 decimals


def test_resume_continues_the_same_curve_bit_identically(data, tmp_path):
    Trainer(model(), data, TrainConfig(**CFG), tmp_path / "full", progress=False).fit()
    # stop after 6 steps (a checkpoint is written there), then resume to 12 in a fresh trainer
    Trainer(model(), data, TrainConfig(**CFG), tmp_path / "part", progress=False).fit(stop_at=6)
    t = Trainer(model(), data, TrainConfig(**CFG), tmp_path / "part", progress=False)
    assert t.resume() and t.step == 6
    t.fit()
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    a, _, _ = load_checkpoint(tmp_path / "full")
    b, _, _ = load_checkpoint(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_stops_with_a_message_and_keeps_the_last_checkpoint(data, tmp_path):
    m = model()
    t = Trainer(m, data, TrainConfig(**{**CFG, "steps": 20}), tmp_path / "nan", progress=False)
    orig = m.forward

    def poisoned(idx, **kw):
        out = orig(idx, **kw)
        return out * float("nan") if t.step >= 7 else out
    m.forward = poisoned
    with pytest.raises(TrainingDiverged, match="at step 8"):
        t.fit()
    _, _, meta = load_checkpoint(tmp_path / "nan")
    assert meta["step"] == 6


def test_truncated_or_corrupted_checkpoint_is_refused(data, tmp_path):
    Trainer(model(), data, TrainConfig(**{**CFG, "steps": 6}), tmp_path / "r", progress=False).fit()
    ck = next((tmp_path / "r" / "ckpt").glob("step_*"))
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(tmp_path / "r")
    (ck / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json is corrupted"):
        load_checkpoint(ck)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tmp_path)


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(5) == pytest.approx(0.5) and cfg.lr_at(10) == pytest.approx(1.0)
    assert cfg.lr_at(100) == pytest.approx(0.1) and cfg.lr_at(55) < 1.0
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_past_the_schedule_the_rate_stays_where_the_schedule_ended():
    """A resume past the schedule (``schedule_steps`` < ``steps``) trains at the rate of the schedule's last step:
    the floor; a schedule of 20 steps with a 50-step warmup ended at 20/50 of lr, and stays there (it once went
    on warming up to lr at step 50, then fell to the floor)."""
    cut = TrainConfig(steps=60, schedule_steps=20, warmup=50, lr=1.0, min_lr_ratio=0.1)
    assert [cut.lr_at(s) for s in (10, 20)] == [pytest.approx(0.2), pytest.approx(0.4)]
    assert [cut.lr_at(s) for s in (21, 35, 50, 51, 60)] == [pytest.approx(0.4)] * 5
    full = TrainConfig(steps=100, schedule_steps=40, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert [full.lr_at(s) for s in (40, 41, 100)] == [pytest.approx(0.1)] * 3


def test_decay_groups_spare_mamba1s_a_log_matrix_and_d():
    """Mamba-1's A_log is a (d_inner, N) matrix: the dim rule alone would decay it; its mark spares it. Every
    other matrix is decayed, every vector spared (the groups are computed here from names, independently)."""
    from subquad.models import LanguageModel, ModelConfig
    from subquad.train.trainer import decay_groups

    m = LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, pattern="mamba", mlp=False))
    decayed, spared = (set(map(id, g["params"])) for g in decay_groups(m, 0.1))
    names = dict(m.named_parameters())
    for n, p in names.items():
        expect_spared = p.dim() < 2 or n.endswith(".A_log") or n.endswith(".D")
        assert (id(p) in spared) == expect_spared and (id(p) in decayed) != expect_spared, n
    assert any(n.endswith(".A_log") and p.dim() == 2 for n, p in names.items())
