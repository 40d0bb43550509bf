"""The generic battery a mixer of the table must pass: ``check_mixer("tiny_decay")``.

Every mechanism in ``subquad.layers.registry.MIXERS`` - and one a user registers with ``register_mixer`` -
is checked the same way, against simpler computations of the same layer:

    contract   a ``Mixer``: ``mix(x, state, seq)``, ``empty_state(batch_size, device, dtype)``, FLOPs
    decode     one forward equals a prefill then token-by-token steps (float64), from ``empty_state`` too;
               a state passed in is not modified, and reusing it gives the same answer
    rollback   speculative decoding's verification: after k tokens from a state, rolling back to any j <= k
               (``MixerEntry.rollback``: truncate a KV cache, or replay) equals prefilling exactly those
               tokens (float64), and decoding continues from it as from the prefilled state
    varlen     a packed row (``cu_seqlens``) equals each sequence alone, outputs and gradients (float64)
    bf16       under bfloat16 autocast the output is finite and near float32's
    compile    ``torch.compile`` (graph capture) equals eager
    model      the name works in a pattern: a hybrid language model trains a step and generates
    context_parallel (opt-in: spawns processes) two ranks over one sequence equal one process, outputs and
               gradients - the layer reaches across tokens only through ``seq``, so this holds without
               any distributed code in it
    encoder    (an ``encoder_only`` entry, in place of decode, varlen, model and context_parallel, which
               need a causal form) the output has the input's shape and each row of a batch equals that
               row alone (float64), gradients agree with finite differences, and a state, packed
               sequences or a wrong width are refused with ValueError

Which checks apply is read from the table (``MixerEntry.encoder_only``); ``check_mixer`` runs those and
returns their names.

Each check raises AssertionError naming the mixer and what differs. The contract tests run it over the
whole table (tests/test_contract.py); the README's "new mixer" example runs it on its own mixer.
"""

from __future__ import annotations

import inspect

import torch

F64 = torch.float64
CHECKS = ("contract", "decode", "rollback", "varlen", "bf16", "compile", "model", "encoder")
CAUSAL = ("decode", "rollback", "varlen", "model", "context_parallel")   # need a causal form: not for an encoder-only entry
ENCODER = ("encoder",)                                      # an encoder-only entry's, in their place
LENGTHS = [5, 1, 9, 3]


def _layer(name, d_model, n_heads, options, dtype=F64):
    from subquad.layers.registry import build_mixer

    torch.manual_seed(0)
    return build_mixer(name, d_model, n_heads, **options).to(dtype)


def _snapshot(state):
    from subquad.ops import KVCache

    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, KVCache):
        return (state.k.clone(), state.v.clone(), state.seen, len(state))
    if isinstance(state, dict):
        return {n: _snapshot(t) for n, t in state.items()}
    return state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[n], b[n]) for n in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_contract(name, d_model=16, n_heads=2, options=None):
    from subquad.layers.base import Mixer
    from subquad.layers.registry import MIXERS

    cls = MIXERS[name].cls
    assert issubclass(cls, Mixer), f"{name}: {cls.__name__} is not a Mixer"
    assert cls.forward is Mixer.forward, f"{name}: layers write mix(); the shared preamble stays in Mixer.forward"
    mix_args = ["self", "x", "state", "seq"] + (["carry"] if cls.uses_carry else [])
    assert list(inspect.signature(cls.mix).parameters) == mix_args, f"{name}: mix({', '.join(mix_args[1:])})"
    es = inspect.signature(cls.empty_state).parameters
    assert list(es) == ["self", "batch_size", "device", "dtype"], f"{name}: empty_state(batch_size, device, dtype)"
    layer = _layer(name, d_model, n_heads, options or {})
    assert layer.flops_per_token(64) > 0, f"{name}: flops_per_token must be positive"
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(0), dtype=F64)
    causal = not MIXERS[name].encoder_only
    with torch.no_grad():
        for start in ((None, layer.empty_state(2, dtype=F64)) if causal else (None,)):
            what = "no state" if start is None else "empty_state(2)"
            try:
                y, state = layer(x, start)
            except Exception as e:                    # a KeyError deep in mix: say whose and from what
                raise AssertionError(f"{name}: its forward from {what} failed: {type(e).__name__}: {e}") from e
            assert tuple(y.shape) == tuple(x.shape), \
                f"{name}: mix returned {tuple(y.shape)} for x {tuple(x.shape)}: the output is x's shape (B, T, d_model)"
            if causal:
                want = sorted(layer.empty_state(2, dtype=F64))
                assert isinstance(state, dict) and sorted(state) == want, \
                    f"{name}: mix returned a state holding {sorted(state) if isinstance(state, dict) else state!r}; " \
                    f"empty_state holds {want}"


def check_decode(name, d_model=16, n_heads=2, options=None, T=11, split=6):
    layer = _layer(name, d_model, n_heads, options or {})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, T, d_model, generator=g, dtype=F64)
    with torch.no_grad():
        full, _ = layer(x)
        for start in (None, layer.empty_state(2, dtype=F64)):
            y, state = layer(x[:, :split], start)
            before = _snapshot(state)
            ys = [y]
            steps = state
            for t in range(split, T):
                yt, steps = layer(x[:, t:t + 1], steps)
                ys.append(yt)
            torch.testing.assert_close(torch.cat(ys, 1), full, rtol=0, atol=1e-9,
                                       msg=lambda m: f"{name}: prefill + steps differ from one forward: {m}")
            assert _same(_snapshot(state), before), f"{name}: a state passed in was modified"
            again, _ = layer(x[:, split:split + 1], state)
            torch.testing.assert_close(again, ys[1], rtol=0, atol=0,
                                       msg=lambda m: f"{name}: reusing a state changed the answer: {m}")


def check_rollback(name, d_model=16, n_heads=2, options=None, T=5):
    from subquad.layers.registry import MIXERS
    from subquad.layers.rollback import roll_back, same_state

    layer = _layer(name, d_model, n_heads, options or {})
    kind = MIXERS[name].rollback
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for prefix in (0, 4):
            x = torch.randn(2, prefix + T + 1, d_model, generator=g, dtype=F64)
            before = layer(x[:, :prefix])[1] if prefix else layer.empty_state(2, dtype=F64)
            for keep in range(T + 1):
                _, after = layer(x[:, prefix:prefix + T], before)           # the verification, fresh each time
                got = roll_back(kind, before, after, T, keep,
                                lambda j, x=x, p=prefix, s=before: layer(x[:, p:p + j], s)[1])
                n = prefix + keep
                want = layer(x[:, :n])[1] if n else layer.empty_state(2, dtype=F64)
                why = same_state(got, want, atol=1e-9)
                assert why is None, f"{name}: rolled back to {keep} of {T} tokens ({kind}) != prefilled: {why}"
                nxt = x[:, n:n + 1]
                torch.testing.assert_close(layer(nxt, got)[0], layer(nxt, want)[0], rtol=0, atol=1e-9,
                                           msg=lambda m, keep=keep: f"{name}: decoding after a rollback to {keep}: {m}")
            if kind == "states":
                _check_states(name, layer, x, prefix, T, before)


def _check_states(name, layer, x, prefix, T, before):
    """A "states" mixer under ``PerToken``: the same output, and the state after each verified token - taken
    for one keep or one per row (``pick``) - equal to prefilling exactly those tokens."""
    from subquad.layers.rollback import PER_TOKEN, pick, same_state
    from subquad.layers.sequence import use

    y, after = layer(x[:, prefix:prefix + T], before)
    with use(PER_TOKEN):
        y2, per = layer(x[:, prefix:prefix + T], before)
    torch.testing.assert_close(y2, y, rtol=0, atol=1e-9, msg=lambda m: f"{name}: output under PerToken: {m}")
    if set(per) != set(after):
        raise AssertionError(f"{name}: state entries under PerToken {sorted(per)} != {sorted(after)}")
    B = x.shape[0]
    for keep in [*range(1, T + 1), torch.tensor([T, 1][:B])]:
        got = {k: pick(before[k], v, keep) for k, v in per.items()}
        rows = keep.tolist() if isinstance(keep, torch.Tensor) else [keep] * B
        for b, n in enumerate(rows):
            want = layer(x[b:b + 1, :prefix + n])[1]
            why = same_state({k: v[b:b + 1] for k, v in got.items()}, want, atol=1e-9)
            assert why is None, f"{name}: the state after {n} of {T} verified tokens (PerToken, row {b}): {why}"


def check_varlen(name, d_model=16, n_heads=2, options=None, lengths=LENGTHS):
    layer = _layer(name, d_model, n_heads, options or {})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, sum(lengths), d_model, generator=g, dtype=F64, requires_grad=True)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    y, _ = layer(x, cu_seqlens=cu)
    w = torch.randn(y.shape, generator=g, dtype=F64)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * w).sum(), [x] + params, allow_unused=True)
    parts, s = [], 0
    for n in lengths:
        parts.append(layer(x[:, s:s + n])[0])
        s += n
    ref = torch.cat(parts, 1)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-9, msg=lambda m: f"{name}: packed != separate: {m}")
    ref_grads = torch.autograd.grad((ref * w).sum(), [x] + params, allow_unused=True)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None), f"{name}: a gradient exists in one form only"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-8, msg=lambda m: f"{name}: packed gradients: {m}")


def check_bf16(name, d_model=16, n_heads=2, options=None, T=37):
    layer = _layer(name, d_model, n_heads, options or {}, torch.float32)
    x = torch.randn(2, T, d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, _ = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, state = layer(x)
    assert torch.isfinite(y).all(), f"{name}: bf16 autocast gave non-finite outputs"
    err = (y.float() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err < 0.05, f"{name}: bf16 autocast is {err:.3g} off float32 (relative norm)"


def check_compile(name, d_model=16, n_heads=2, options=None, T=21):
    layer = _layer(name, d_model, n_heads, options or {}, torch.float32)
    x = torch.randn(2, T, d_model, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    with torch.no_grad():
        ref, _ = layer(x)
        y, _ = compiled(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: compiled != eager: {m}")


def check_model(name, d_model=16, n_heads=2, options=None):
    from subquad.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=d_model, n_layers=2, n_heads=n_heads, context_length=32,
                      pattern=f"{name},softmax", mixer_options={name: dict(options or {})})
    model = LanguageModel(cfg)
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(5))
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), idx[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss), f"{name}: non-finite loss in a hybrid model"
    model.eval()
    outs, _ = model.generate([[1, 2, 3], [4]], 4, temperature=0)
    assert [len(o) for o in outs] == [4, 4], f"{name}: generation in a hybrid model"


def check_encoder(name, d_model=16, n_heads=2, options=None, T=7):
    layer = _layer(name, d_model, n_heads, options or {})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, T, d_model, generator=g, dtype=F64)
    y, state = layer(x)
    assert y.shape == x.shape and y.dtype == F64, f"{name}: output {tuple(y.shape)} {y.dtype} for input {tuple(x.shape)}"
    assert state is None, f"{name}: an encoder-only layer gives no decoding state"
    rows = torch.cat([layer(x[b:b + 1])[0] for b in range(x.shape[0])])
    torch.testing.assert_close(y, rows, rtol=0, atol=1e-12, msg=lambda m: f"{name}: a batch != its rows alone: {m}")
    small = x[:1, :3].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: layer(t)[0], (small,), eps=1e-6, atol=1e-7), f"{name}: gradients"
    for what, bad, kwargs in (("a state", x, {"state": {}}), ("a wrong width", x[..., :-1], {}),
                              ("packed sequences", x[:1], {"cu_seqlens": torch.tensor([0, 3, T], dtype=torch.int32)})):
        try:
            layer(bad, **kwargs)
        except ValueError:
            continue
        raise AssertionError(f"{name}: {what} was not refused with ValueError")


def _cp_worker(rank, world, name, cls, entry, d_model, n_heads, options, x, w):
    from subquad.distributed import context_parallel, zigzag_shard
    from subquad.layers.registry import MIXERS, register_mixer
    import torch.distributed as dist

    if name not in MIXERS:                                       # a mixer registered in the parent only
        register_mixer(name, cls, **entry)
    layer = _layer(name, d_model, n_heads, options)
    with context_parallel() as cp:
        y, state = layer(zigzag_shard(x, cp.rank, cp.world))
    (y * zigzag_shard(w, rank, world)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in layer.parameters() if p.grad is not None])
    dist.all_reduce(grads)
    return y.detach(), grads, state


def check_context_parallel(name, d_model=16, n_heads=2, options=None, world=2, T=24):
    """Spawns ``world`` processes, which find the layer's class by its module: one that imports, or the script
    itself (spawned processes run it again as ``__mp_main__``: its ``check_mixer`` call then goes under
    ``if __name__ == "__main__":``)."""
    import dataclasses

    from subquad.distributed import zigzag_unshard
    from subquad.distributed.launch import run_local
    from subquad.layers.registry import MIXERS

    options = dict(options or {})
    e = MIXERS[name]
    entry = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name != "cls"}
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, T, d_model, generator=g, dtype=F64)
    w = torch.randn(2, T, d_model, generator=g, dtype=F64)
    out = run_local(world, _cp_worker, name, e.cls, entry, d_model, n_heads, options, x, w, timeout_s=120)
    layer = _layer(name, d_model, n_heads, options)
    ref, _ = layer(x)
    (ref * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in layer.parameters() if p.grad is not None])
    torch.testing.assert_close(zigzag_unshard([o[0] for o in out]), ref.detach(), rtol=0, atol=1e-9,
                               msg=lambda m: f"{name}: {world} ranks != one process: {m}")
    for _, gr, state in out:
        torch.testing.assert_close(gr, grads, rtol=0, atol=1e-8, msg=lambda m: f"{name}: gradients across ranks: {m}")
        assert state is None, f"{name}: a shard of a sequence must give no decoding state"


_CHECKS = {"contract": check_contract, "decode": check_decode, "rollback": check_rollback, "varlen": check_varlen, "bf16": check_bf16,
           "compile": check_compile, "model": check_model, "context_parallel": check_context_parallel,
           "encoder": check_encoder}


def check_mixer(name: str, *, d_model: int = 16, n_heads: int = 2, options: dict | None = None,
                checks=CHECKS, context_parallel: bool = False) -> list[str]:
    """Run the battery (``checks``, plus ``context_parallel``) on mixer ``name`` of the table with
    ``options``, the checks that apply to it (an ``encoder_only`` entry: not ``CAUSAL``; any other: not
    ``ENCODER``); returns the checks passed, raises AssertionError at the first that fails."""
    from subquad.layers.registry import MIXERS

    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; register it first (subquad.layers.registry.register_mixer)")
    todo = list(checks) + (["context_parallel"] if context_parallel else [])
    for c in todo:
        if c not in _CHECKS:
            raise ValueError(f"unknown check {c!r}; known: {', '.join(_CHECKS)}")
    skip = CAUSAL if MIXERS[name].encoder_only else ENCODER
    todo = [c for c in todo if c not in skip]
    for c in todo:
        _CHECKS[c](name, d_model, n_heads, options)
    return todo


__all__ = ["check_mixer", "CHECKS", "CAUSAL", "ENCODER"]


def random_rwkv7_pth(path, vocab: int, d_model: int, n_layers: int, ranks: dict, mlp: int | None = None,
                     head_size: int = 64, seed: int = 0) -> dict:
    """A random RWKV-7 checkpoint in BlinkDL's ``.pth`` layout (RWKV-LM's key names and shapes) at ``path``,
    returned as its dict: for tests against the ``rwkv`` package and for benchmarks at a release's shape
    (RWKV-7 0.1B: vocab 65,536, d_model 768, 12 layers, ranks {"w": 64, "a": 64, "v": 32, "g": 128}).
    ``ranks``: the LoRA ranks of w, a, v and g; ``mlp``: the channel mix's width (default 4 d_model)."""
    g = torch.Generator().manual_seed(seed)
    V, D, N, mlp = vocab, d_model, head_size, mlp or 4 * d_model

    def r(*shape, std=0.3):
        return torch.randn(*shape, generator=g) * std

    def u(*shape):
        return torch.rand(*shape, generator=g)

    z = {"emb.weight": r(V, D, std=1.0), "ln_out.weight": 1 + r(D, std=0.1), "ln_out.bias": r(D, std=0.1),
         "head.weight": r(V, D, std=0.2), "blocks.0.ln0.weight": 1 + r(D, std=0.1), "blocks.0.ln0.bias": r(D, std=0.1)}
    for i in range(n_layers):
        p, a, f = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for n in ("ln1", "ln2"):
            z[p + n + ".weight"], z[p + n + ".bias"] = 1 + r(D, std=0.1), r(D, std=0.1)
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            z[a + n] = u(1, 1, D)
        for n, rank in ranks.items():
            if n != "g":
                z[a + n + "0"] = r(1, 1, D, std=1.0)
            z[a + n + "1"], z[a + n + "2"] = r(D, rank), r(rank, D)
        z[a + "k_k"], z[a + "k_a"], z[a + "r_k"] = 1 + r(1, 1, D, std=0.1), u(1, 1, D), r(D // N, N)
        for n in ("receptance", "key", "value", "output"):
            z[a + n + ".weight"] = r(D, D, std=D ** -0.5)
        z[a + "ln_x.weight"], z[a + "ln_x.bias"] = 1 + r(D, std=0.1), r(D, std=0.1)
        z[f + "x_k"] = u(1, 1, D)
        z[f + "key.weight"], z[f + "value.weight"] = r(mlp, D, std=D ** -0.5), r(D, mlp, std=mlp ** -0.5)
    torch.save(z, path)
    return z
