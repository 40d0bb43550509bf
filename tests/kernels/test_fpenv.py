"""kernels.fpenv: denormals flushed to zero on the calling thread and torch's threads inside the scope only -
nested scopes, the switch, and a model's calls leave the process's IEEE denormals as they found them."""

from __future__ import annotations

import pytest
import torch

from subquad.kernels import fpenv

pytestmark = pytest.mark.skipif(not fpenv.KERNEL.available(), reason="no C compiler: the kernel cannot be built")
TINY = 1e-39                                            # a denormal float32


def survivors(n=1 << 20) -> int:
    """How many of n denormals survive a multiplication by one, split over torch's threads."""
    return int((torch.full((n,), TINY) * 1.0).ne(0).sum())


@pytest.fixture
def two_threads():
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


def test_inside_flushed_on_every_thread_outside_not(two_threads):
    n = 1 << 20
    assert survivors(n) == n
    with fpenv.flush_denormals():
        assert survivors(n) == 0
        with fpenv.flush_denormals():
            pass
        assert survivors(n) == 0                        # a nested scope leaves it on
    assert survivors(n) == n


def test_the_switch_and_a_models_calls(monkeypatch, two_threads):
    monkeypatch.setenv("SUBQUAD_FLUSH_DENORMALS", "0")
    with fpenv.flush_denormals():
        assert survivors() == 1 << 20
    monkeypatch.setenv("SUBQUAD_FLUSH_DENORMALS", "1")
    from subquad.models import LanguageModel, ModelConfig

    m = LanguageModel(ModelConfig(vocab_size=50, d_model=32, n_layers=2, pattern="mamba2,softmax")).eval()
    seen = []
    m.blocks[0].register_forward_hook(lambda *a: seen.append(survivors()))
    with torch.no_grad():
        _, st = m.prefill(torch.tensor([[1, 2, 3]]))
        m.step(torch.tensor([4]), st)
    assert seen == [0, 0] and survivors() == 1 << 20     # flushed in the blocks, restored after
