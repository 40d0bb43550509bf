"""Float32 products through oneDNN at inference: ``linear(x, w, bias)`` is ``F.linear`` with another kernel.

    y = x @ w.T + bias            x (..., K), w (N, K), bias (N,) or None -> (..., N)

On CPU, PyTorch's ``F.linear`` calls MKL's GEMM, which streams a matrix at 12-15 GB/s on a one-token decoding
step on the AMD Zen 4 hosts (the read bound is ~27 GB/s) and costs 3-4x a one-row product at 8-16 rows - a
speculative verification's and a batched step's shapes. oneDNN's inner-product primitive
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU freezing uses) reads the same row-major (or
column-major) weights at the bound and keeps 9 rows near one row's time: measured in benchmarks/RESULTS.md
("oneDNN for the float32 products"). So without autograd, on CPU, in float32, every ``Linear`` of a model
(``Linear``, which ``LanguageModel`` gives its ``nn.Linear`` layers) and the tied head take it when the matrix
holds >= ``MIN_WEIGHTS`` weights (below, oneDNN's fixed ~14 us per call costs more than it saves); training,
other devices and dtypes keep ``F.linear``. ``SUBQUAD_ONEDNN=0`` turns it off (the reference).

Up to ``C_ROWS`` rows (a decoding step's, a verification's, a served batch's) a row-major matrix goes to the
C kernel of ``kernels.qgemv`` (``f32_gemv``) where it builds: it reads the matrix once for all rows, at the
read bound up to ~8 rows and at 64-75% of the matmul rate at 16, where oneDNN's cost grows with the rows
(mamba-130m's vocabulary head from memory, AVX2 EPYC: 5.0 against 4.4 ms at one row, 6.6 against 12.2 at 8,
9.2 against 16.6 at 16; ``bench_qgemv.py --from-memory``).

Past ``MKL_ROWS`` rows (a prompt's products) an Intel CPU keeps MKL's GEMM: on the Sapphire Rapids host MKL is
1-16% faster from ~512 rows up (4-10% at 1,024 and 2,048 rows of LFM3's and xLSTM's matrices) and oneDNN up to 9%
faster below, while on the AMD EPYC hosts oneDNN was 1.3-1.4x faster at 2,048 rows (benchmarks/RESULTS.md, "MKL
for an Intel CPU's prompts"); elsewhere oneDNN keeps every row count. ``SUBQUAD_MKL_ROWS=N`` sets the rows
(0: oneDNN at any count).

Inside a compiled graph the call is the custom op ``subquad::dense_linear`` (inductor's own lowering of the
oneDNN op wants a frozen weight); eagerly it is the oneDNN op itself (no custom op's dispatch per call).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.kernels import qgemv

ONEDNN = (os.environ.get("SUBQUAD_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
          and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
MIN_WEIGHTS = 1 << 18       # smaller matrices keep F.linear: oneDNN's ~14 us per call outweighs what it saves
C_ROWS = 16                 # up to this many rows the C kernel (module doc)


def _intel() -> bool:
    """Whether this CPU is Intel's (``/proc/cpuinfo``'s vendor_id; False where it cannot be read)."""
    return "GenuineIntel" in kernels.cpuinfo()


def _mkl_rows() -> int | None:
    """The rows past which a product keeps MKL (module doc), or None: oneDNN at any count."""
    rows = os.environ.get("SUBQUAD_MKL_ROWS")
    if rows is not None:
        return int(rows) or None
    return 512 if _intel() else None


MKL_ROWS = _mkl_rows()


def _onednn(x, w, bias):
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), w, bias, "none", [], "")


def _dense(x, w, bias):
    """oneDNN's product, the C kernel's for a few rows of a row-major matrix, or MKL's past ``MKL_ROWS``."""
    if w.is_contiguous() and qgemv.usable(qgemv.F32, x, C_ROWS) and (bias is None or bias.is_contiguous()):
        return qgemv.f32_gemv(x, w, bias)
    if MKL_ROWS is not None and x.numel() > MKL_ROWS * x.shape[-1]:
        return F.linear(x, w, bias)
    return _onednn(x, w, bias)


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor")
_LIB.impl("dense_linear", _dense, "CPU")


@torch.library.register_fake("subquad::dense_linear")
def _(x, w, bias):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through oneDNN where the module doc says."""
    if (ONEDNN and x.dtype == torch.float32 and w.dtype == torch.float32 and x.is_cpu
            and w.is_cpu and w.dim() == 2 and x.dim() >= 2 and w.numel() >= MIN_WEIGHTS
            and not torch.is_grad_enabled()
            and (bias is None or bias.dtype == torch.float32)):
        if torch.compiler.is_compiling():
            return torch.ops.subquad.dense_linear(x, w, bias)
        return _dense(x, w, bias)
    return F.linear(x, w, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose inference product is ``linear`` (same parameters, state dict and training)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def use_linear(model: nn.Module) -> nn.Module:
    """Make every plain ``nn.Linear`` of ``model`` a ``Linear`` (in place: the class only); returns the model."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear
    return model
