import pytest
import torch

from subquad.tasks import answer_accuracy, mqar
from subquad.tasks.mqar import IGNORE


def test_format_and_label_positions():
    T, N, V = 64, 4, 128
    x, y = mqar(50, T, N, V, seed=0)
    assert x.shape == y.shape == (50, T) and x.dtype == torch.long
    for i in range(50):
        keys, values = x[i, 0:2 * N:2], x[i, 1:2 * N:2]
        assert (keys >= 1).all() and (keys < V // 2).all() and len(set(keys.tolist())) == N
        assert (values >= V // 2).all() and (values < V).all()
        pos = (y[i] != IGNORE).nonzero().flatten()
        assert len(pos) == N and (pos >= 2 * N).all()
        kv = dict(zip(keys.tolist(), values.tolist()))
        for p in pos.tolist():
            assert x[i, p].item() in kv and y[i, p].item() == kv[x[i, p].item()]   # query key -> its value


def test_seeded_and_power_law_spacing():
    a, _ = mqar(200, 128, 8, 512, seed=1)
    b, _ = mqar(200, 128, 8, 512, seed=1)
    assert torch.equal(a, b)
    _, y = mqar(2000, 128, 8, 512, seed=2)
    pos = (y != IGNORE).nonzero()[:, 1].float() - 16
    assert (pos < 56).float().mean() > 0.5          # most queries soon after the context, some far


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="vocab_size > seq_len"):
        mqar(1, 64, 4, 64)
    with pytest.raises(ValueError, match="4 \\* num_kv_pairs <= seq_len"):
        mqar(1, 64, 17, 512)
    with pytest.raises(ValueError, match="even seq_len"):
        mqar(1, 63, 4, 512)


def test_accuracy_counts_only_answer_positions():
    labels = torch.full((1, 6), IGNORE)
    labels[0, 2], labels[0, 5] = 7, 9
    logits = torch.zeros(1, 6, 10)
    logits[0, :, 0] = 5                  # everything predicts 0 ...
    logits[0, 2, 7] = 9                  # ... except one answer, right
    assert answer_accuracy(logits, labels) == 0.5
    with pytest.raises(ValueError, match="no answer positions"):
        answer_accuracy(logits, torch.full((1, 6), IGNORE))
