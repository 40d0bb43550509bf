"""subquad.ops.common.memory: fresh tensors advised to huge pages are ordinary tensors."""

import torch

from subquad.ops.common import memory


def test_empty_large_is_an_ordinary_tensor():
    t = memory.empty(3, memory.MIN_BYTES // 4, dtype=torch.float32)      # 3x MIN_BYTES
    assert t.shape == (3, memory.MIN_BYTES // 4) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def test_small_and_odd_tensors_are_not_advised():
    assert memory.advise_huge(torch.empty(1000)) is False                 # under MIN_BYTES
    assert memory.empty(0, 4).shape == (0, 4)
    assert memory.empty((2, 3), dtype=torch.float64).dtype == torch.float64


def test_advice_covers_only_whole_huge_pages_inside_the_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda addr, n, advice: calls.append((addr, n, advice)) or 0)
    t = torch.empty(memory.MIN_BYTES + 12345, dtype=torch.uint8)
    assert memory.advise_huge(t) is True
    (addr, n, advice), = calls
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    assert advice == memory.MADV_HUGEPAGE
    assert addr % memory.HUGE == 0 and n % memory.HUGE == 0 and n > 0
    assert start <= addr and addr + n <= end                              # never past the tensor's own bytes


def test_refused_advice_is_harmless(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda addr, n, advice: -1)
    t = memory.empty(memory.MIN_BYTES // 4 + 1)
    assert t.numel() == memory.MIN_BYTES // 4 + 1
    monkeypatch.setattr(memory, "_madvise", None)
    assert memory.advise_huge(t) is False
