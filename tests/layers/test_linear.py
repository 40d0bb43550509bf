"""``layers.linear``: the inference product through oneDNN or the C kernel equals the float64 product, keeps
autograd's path
when gradients are on, runs inside a compiled graph as ``subquad::dense_linear``, and every plain Linear of a
model takes it without changing the state dict."""

import pytest
import torch
from torch import nn

from subquad.layers import linear as L
from subquad.models import LanguageModel, ModelConfig


def reference(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("layout", ["row", "col", "strided x"])
def test_the_onednn_product_equals_the_float64_product(rows, layout):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(520, 512, generator=g)                 # >= MIN_WEIGHTS: oneDNN's path
    b = torch.randn(520, generator=g)
    x = torch.randn(2, rows, 512, generator=g)
    if layout == "col":
        w = w.T.contiguous().T                             # decode_layout's column-major storage
    if layout == "strided x":
        x = torch.randn(2, rows, 1024, generator=g)[..., ::2]
    assert w.numel() >= L.MIN_WEIGHTS
    with torch.no_grad():
        for bias in (b, None):
            got = L.linear(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == (2, rows, 520)
            torch.testing.assert_close(got.double(), reference(x, w, bias), rtol=0, atol=2e-4)


def test_a_few_rows_of_a_row_major_matrix_take_the_c_kernel(monkeypatch):
    from subquad.kernels import qgemv

    if not (L.ONEDNN and qgemv.F32.available()):
        pytest.skip("oneDNN or the C kernels are not available here")
    calls = []
    real = qgemv.f32_gemv
    monkeypatch.setattr(qgemv, "f32_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(520, 512, generator=g)
    with torch.no_grad():
        for x, taken in ((torch.randn(1, 512), True), (torch.randn(2, 8, 512), True),
                         (torch.randn(L.C_ROWS + 1, 512), False)):
            calls.clear()
            torch.testing.assert_close(L.linear(x, w).double(), reference(x, w, None), rtol=0, atol=2e-4)
            assert bool(calls) == taken, (x.shape, calls)
        calls.clear()
        L.linear(torch.randn(1, 512), w.T.contiguous().T)        # column-major: oneDNN's
        assert not calls


def test_past_mkl_rows_a_product_keeps_mkl_and_below_it_onednn(monkeypatch):
    """``MKL_ROWS`` (an Intel CPU's default 512, ``SUBQUAD_MKL_ROWS`` otherwise): F.linear past it, oneDNN up to
    it, each equal to the float64 product; None: oneDNN at any count."""
    if not L.ONEDNN:
        pytest.skip("oneDNN is not available in this torch build (or SUBQUAD_ONEDNN=0)")
    seen = []
    real = L.F.linear
    monkeypatch.setattr(L.F, "linear", lambda *a: seen.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(520, 512, generator=g), torch.randn(520, generator=g)
    with torch.no_grad():
        for limit, x, mkl in ((40, torch.randn(2, 21, 512, generator=g), True), (40, torch.randn(2, 20, 512), False),
                              (None, torch.randn(3, 100, 512), False)):
            monkeypatch.setattr(L, "MKL_ROWS", limit)
            seen.clear()
            torch.testing.assert_close(L.linear(x, w, b).double(), reference(x, w, b), rtol=0, atol=2e-4)
            assert bool(seen) == mkl, (limit, x.shape)
    monkeypatch.setenv("SUBQUAD_MKL_ROWS", "0")
    assert L._mkl_rows() is None
    monkeypatch.setenv("SUBQUAD_MKL_ROWS", "300")
    assert L._mkl_rows() == 300
    monkeypatch.delenv("SUBQUAD_MKL_ROWS")
    assert L._mkl_rows() == (512 if L._intel() else None)


def test_training_and_other_dtypes_keep_f_linear():
    w = nn.Parameter(torch.randn(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    L.linear(x, w).sum().backward()                         # oneDNN's op has no backward: F.linear's
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(8, 4))
    with torch.no_grad():
        xd, wd = x.double(), w.double()
        assert L.linear(xd, wd).dtype == torch.float64
        torch.testing.assert_close(L.linear(xd, wd), xd @ wd.T, rtol=0, atol=0)


def test_a_compiled_graph_calls_the_custom_op():
    if not L.ONEDNN:
        pytest.skip("oneDNN is not available in this torch build (or SUBQUAD_ONEDNN=0)")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(520, 512, generator=g), torch.randn(5, 512, generator=g)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    with torch.no_grad():
        got = torch.compile(lambda x: torch.relu(L.linear(x, w)), backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(got.double(), torch.relu(reference(x, w, None)), rtol=0, atol=2e-4)
        inductor = torch.compile(lambda x: torch.relu(L.linear(x, w)), fullgraph=True)(x)
        torch.testing.assert_close(inductor, got, rtol=0, atol=1e-5)
    assert "subquad.dense_linear" in seen


def test_a_models_linears_take_it_and_keep_their_state_dict():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, pattern="mamba,softmax"))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is L.Linear for m in linears)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    keys = plain.state_dict().keys()
    assert L.use_linear(plain) is plain and all(type(m) is L.Linear for m in plain if not isinstance(m, nn.Sequential))
    assert plain.state_dict().keys() == keys and type(plain[1][0]) is L.Linear
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        was = L.ONEDNN, L.MIN_WEIGHTS
        try:
            L.MIN_WEIGHTS = 0                                # every matrix of the tiny model through oneDNN
            fast = model(ids)
            L.ONEDNN = False
            slow = model(ids)
        finally:
            L.ONEDNN, L.MIN_WEIGHTS = was
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
