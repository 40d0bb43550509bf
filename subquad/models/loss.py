"""Next-token loss from the last hidden states without the (N, vocab) logits: the head and the cross-entropy
in chunks of tokens, recomputed in the backward pass.

    loss = mean over targets y_i != ignore_index of  logsumexp(h_i W^T) - (h_i W^T)[y_i]
    h (N, D), W (vocab, D), y (N,)

Forward keeps one float32 number per token (its logsumexp); backward recomputes each chunk's logits and
forms (softmax - onehot) / n in place, then dh = P W and dW += P^T h. At T = 32,768 and vocab 4,096 the
materialised path holds 512 MB of logits plus as much again for their gradient, and its log_softmax runs
from memory (benchmarks/RESULTS.md); the chunks stay ~64 MB. The logits and everything after them are
float32 (as ``F.cross_entropy(logits.float(), ...)``); the head's matmul runs in h's dtype, or autocast's.
"""

from __future__ import annotations

import torch

LOGITS_BYTES = 1 << 26       # float32 logits per chunk: 64 MB


def _cast(t, dtype):
    """t in the head's matmul dtype (autocast's), or as it is."""
    return t if dtype is None else t.to(dtype)


def _chunks(N, vocab, chunk):
    c = chunk or max(1, LOGITS_BYTES // (4 * vocab))
    return [(s, min(s + c, N)) for s in range(0, N, c)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, y, ignore_index, chunk, dtype):
        N = h.shape[0]
        valid = y != ignore_index
        n = valid.sum()
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32      # the logits' dtype from here on
        lse = torch.empty(N, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=lse.dtype, device=h.device)
        Wm = _cast(W, dtype)
        for s, e in _chunks(N, W.shape[0], chunk):
            z = _cast(h[s:e], dtype) @ Wm.T
            z = z.to(lse.dtype)
            lse[s:e] = torch.logsumexp(z, -1)
            yc, vc = y[s:e].clamp(min=0), valid[s:e]
            total += ((lse[s:e] - z.gather(1, yc[:, None])[:, 0]) * vc).sum()
        ctx.save_for_backward(h, W, y, lse, n)
        ctx.ignore_index, ctx.chunk, ctx.dtype = ignore_index, chunk, dtype
        return total / n

    @staticmethod
    def backward(ctx, grad):
        h, W, y, lse, n = ctx.saved_tensors
        dtype = ctx.dtype
        Wm = _cast(W, dtype)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dW = torch.zeros(W.shape, dtype=lse.dtype, device=W.device) if ctx.needs_input_grad[1] else None
        scale = grad / n
        for s, e in _chunks(h.shape[0], W.shape[0], ctx.chunk):
            hc = _cast(h[s:e], dtype)
            p = (hc @ Wm.T).to(lse.dtype).sub_(lse[s:e, None]).exp_()          # softmax, (c, vocab)
            yc = y[s:e]
            valid = yc != ctx.ignore_index
            p[torch.arange(e - s, device=p.device), yc.clamp(min=0)] -= 1
            p.mul_((valid * scale).to(p.dtype)[:, None])                         # ignored rows: no gradient
            pm = p.to(hc.dtype)
            if dh is not None:
                dh[s:e] = (pm @ Wm).to(h.dtype)
            if dW is not None:
                dW += (pm.T @ hc).to(dW.dtype)
        return dh, None if dW is None else dW.to(W.dtype), None, None, None, None


def linear_cross_entropy(h, weight, targets, ignore_index: int = -100, chunk: int | None = None):
    """Mean cross-entropy of the logits h @ weight^T against targets, never holding all the logits.

    h (..., D); weight (vocab, D); targets (...) integer, ``ignore_index`` skipped (the mean is over the
    rest; nan when every target is ignored, as F.cross_entropy). ``chunk``: tokens per chunk (default:
    64 MB of float32 logits). Equals ``F.cross_entropy((h @ weight.T).float().flatten(0, -2),
    targets.flatten(), ignore_index=ignore_index)``, gradients included; under autocast the head's
    matmul runs in autocast's dtype."""
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"targets must have h's leading shape {tuple(h.shape[:-1])}, got {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
        raise ValueError(f"weight must be (vocab, D={h.shape[-1]}), got {tuple(weight.shape)}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():   # (a device sync elsewhere: not there)
        y = targets[targets != ignore_index]
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= weight.shape[0]):
            bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
            raise ValueError(f"targets must be token ids in [0, {weight.shape[0]}) (the vocabulary) or ignore_index="
                             f"{ignore_index}, got {bad}")
    dtype = None
    if torch.is_autocast_enabled(h.device.type) and h.dtype in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.get_autocast_dtype(h.device.type)
    with torch.autocast(h.device.type, enabled=False):
        out = _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), ignore_index,
                                        chunk, dtype)
    return out
