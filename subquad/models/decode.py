"""A compiled decoding step: one token per row through the whole model without per-op overhead.

    compile_decode(model)            model.step(tokens, state) now runs compiled; generate, `subquad generate`
                                     and the server decode through model.step
    compile_decode(model, False)     back to eager (the reference)
    decode_layout(model)             wide float32 matrices stored column-major, as a one-token step reads them

An eager step of a small model is mostly overhead: some 30-50 small ops per layer, each a dispatch of a few
microseconds on tensors of a few thousand numbers, the Python around them, and the value checks the ops run
on CPU. torch.compile (inductor) fuses each block's elementwise work into a few C++ loops and keeps the
matrix products as library calls (and the quantised ones as ``subquad::int8_linear`` and
``subquad::int4_linear``, ``models.quant``).

One graph holds every block, the final norm and the head; the embedding and the position count run in
Python around it. One graph per block, shared by the blocks of the same structure, would compile several
times faster but pay guards and a call per block on every token, where the whole-model graph pays them once.
Sizes are symbolic from the first compile (``DYNAMIC``), so a KV cache that grows or a batch that changes
size runs the same graph. A mixture of experts stays in the graph too: a step's few rows read their k
experts' weights by index (``MoE._gathered``); a batch with more choices (rows * k > 4 E, ``moe.GATHER``) runs
the routed loop as one op inside the graph (``subquad::moe_experts``: its loop's shapes depend on the routing,
the op's output does not). A state keeps one structure from step to step (``_for_graph``: KV caches with room
to append in place and ragged at >= 2 rows, tensors dense and without a base), so a batch of >= 2 rows runs
one graph and a batch of 1 another (dynamo specialises sizes of 1), whatever the steps between.

Speculative decoding's verification (``models.speculative.verify``) has graphs of its own, one per number of
verified tokens T (``CompiledStep.verifier``): the whole model over (B, T) tokens under
``layers.rollback.PER_TOKEN``, so each recurrent layer's projections run over the T tokens at once while its
recurrence runs token by token and keeps the state after each - accepting j of them takes the j-th, nothing
runs again. Its recurrences unrolled T times, it builds in minutes at mamba-130m's shape (189 s, T = 9),
once per machine: saved as the step's graphs are. (A graph per block structure, shared by the blocks, built
in 12 s but cost 1.7x a step against 1.4x, its calls and guards per block: benchmarks/RESULTS.md.)

Across processes: each graph is saved where ``SUBQUAD_COMPILE_CACHE`` points (default
``~/.cache/subquad/decode``) and the next process that decodes the same model on the same machine loads it
instead of compiling it again (seconds, not a minute: ``benchmarks/RESULTS.md``, "The compiled step across
processes"). A file is named by a hash of everything the graph depends on (``cache_key``: torch and Python, every
``subquad/**/*.py``, the model's config, module types and tensors' names, shapes, strides, dtypes and devices, the
CPU and its vector instructions, the threads) and of the call's specialisation (batch 1 or more, the state's
structure: ``_specialisation``); anything else differs, the name differs and the step compiles. A loaded
graph's own guards still run on every call (a call they refuse takes another graph or compiles one), an
unreadable file is ignored with a warning and rewritten, and a model that dynamo cannot trace whole (a graph
break: ``aot_compile`` needs one graph) runs ``torch.compile``'s graphs of the step, not cached across processes.

Equality: tested against the eager step over 64 steps for every mixer and every checkpoint type
(tests/models/test_decode.py): float32 within 1e-5 of the logits' scale - inductor may reorder a sum.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import platform
import sys
import time
import types
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from subquad.layers import sequence
from subquad.layers.mamba import forget_block_steps
from subquad.models.state import ModelState
from subquad.ops import KVCache

RECOMPILE_LIMIT = 64        # graphs per model: a new one only where the state's structure changes
DYNAMIC = True             # sizes symbolic from the first compile: batches and KV caches change without recompiling
OPTIONS = {"cpp_wrapper": True}   # inductor calls the kernels from C++, not Python: less overhead per token
CACHE_ENV = "SUBQUAD_COMPILE_CACHE"  # the folder of saved graphs; default ~/.cache/subquad/decode (cache_dir)

log = logging.getLogger(__name__)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides and no base: itself when it has them, else a copy. ``contiguous()`` is not
    enough: a (1, 3, D) view of a (1, 4, D) buffer counts as contiguous with stride 4D on dim 0, and the graph
    guards on strides - a short convolution's tail would recompile it once more; and it guards on a view's base
    (a state that a prefill left as a view, the next step's not: once more)."""
    expect, n = [], 1
    for size in reversed(t.shape):
        expect.append(n)
        n *= size
    if t.stride() == tuple(reversed(expect)) and t._base is None:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _for_graph(v, t: int = 1):
    """A state entry as the graph takes it: a tensor with row-major strides and no autograd history (a state
    from a prefill run with gradients on would make the graph guard on ``requires_grad``, and the next step's
    state, made without them, compile it again), a KV cache ready to append ``t`` tokens in place
    (``KVCache.for_step``: no reallocation in the graph, ragged at >= 2 rows)."""
    if isinstance(v, torch.Tensor):
        v = _dense(v)
        return v.detach() if v.requires_grad else v
    if isinstance(v, KVCache):
        c = v.for_step(t)
        if c._k.requires_grad or c._v.requires_grad:      # the same buffers, appended in place by the graph
            c._k, c._v = c._k.detach(), c._v.detach()
        return c
    return v


def _blocks_and_heads(model, h, states, tokens=None):
    """h (B, T, d_model), the per-layer states and the tokens (B, T) -> (logits (B, T, vocab), new per-layer
    states): the graph of a speculative verification (``CompiledStep.verifier``, run under
    ``layers.rollback.PER_TOKEN``)."""
    out, carry = [], model._carry(h, tokens)   # carry: values that cross layers (``LanguageModel._hidden``)
    for block, s in zip(model.blocks, states):
        h, s = block(h, s, carry=carry)
        out.append(s)
    return model._logits(h), out


def _blocks_and_head(model, h, states, tokens=None):
    """h (B, 1, d_model), the per-layer states and the tokens (B, 1) -> (logits (B, vocab), new per-layer states):
    the step's graph."""
    logits, out = _blocks_and_heads(model, h, states, tokens)
    return logits[:, -1], out


def cache_dir(cache=True) -> Path | None:
    """The folder of saved graphs: ``cache`` itself when a path, ``$SUBQUAD_COMPILE_CACHE`` when set, else
    ``$XDG_CACHE_HOME/subquad/decode`` (``~/.cache/subquad/decode``); None with ``cache=False``."""
    if cache is False:
        return None
    if cache is not True:
        return Path(cache)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "subquad" / "decode"


@lru_cache(maxsize=1)
def _machine_key() -> str:
    """What a graph depends on besides the model: torch, Python, subquad's source, the CPU, inductor's options."""
    from torch._inductor import cpu_vec_isa

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]           # the package (importing subquad here would be a cycle)
    for f in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True)):
        h.update(os.path.relpath(f, root).encode() + b"\0" + Path(f).read_bytes() + b"\0")
    from subquad.kernels import cpu_identity
    from subquad.layers.linear import ONEDNN

    for part in (torch.__version__, sys.version, platform.machine(), cpu_identity(), str(cpu_vec_isa.pick_vec_isa()),
                 repr(sorted(OPTIONS.items())), str(DYNAMIC), str(ONEDNN)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def cache_key(model) -> str:
    """A hash of everything the compiled step of ``model`` depends on but the call's specialisation (module doc)."""
    h = hashlib.sha256(_machine_key().encode())
    h.update(f"{type(model).__module__}.{type(model).__qualname__}|{model.config!r}|{torch.get_num_threads()}".encode())
    for name, m in model.named_modules():
        h.update(f"m|{name}|{type(m).__module__}.{type(m).__qualname__}".encode())
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            h.update(f"{kind}|{name}|{tuple(t.shape)}|{t.stride()}|{t.dtype}|{t.device}|{t.requires_grad}".encode())
    return h.hexdigest()[:32]


def _describe(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"T({v.dtype},{v.dim()},{v.device})"
    if isinstance(v, KVCache):
        return f"KV({v.ragged},{v.window},{v.k.dtype},{v.k.dim()})"
    if isinstance(v, (bool, int, float, str)):
        return f"{type(v).__name__}({v!r})"
    return type(v).__qualname__


def _specialisation(h, states) -> str:
    """The call's part of a saved graph's name: batch 1 or more (dynamo specialises sizes of 1) and the state's
    structure, per layer its keys and their kinds. A loaded graph's guards check the rest."""
    layers = ";".join("None" if s is None else ",".join(f"{k}:{_describe(v)}" for k, v in sorted(s.items()))
                      for s in states)
    return f"{'1' if h.shape[0] == 1 else 'B'}|T{h.shape[1]}|{h.dtype}|{layers}"


class CompiledStep:
    """``model.step``'s compiled form (module doc): tokens (B, 1) long, state -> (logits (B, vocab), state).
    ``loaded`` and ``compiled`` count the graphs read from the cache and compiled here (``aot_compile``);
    ``fallback`` is why the step runs ``torch.compile``'s graphs instead (None while it does not). ``made`` counts
    both over every instance (a step that made one is no measure of a step's time: ``speculative.Pacer``)."""

    made = 0
    TRIAL = 4           # timed steps of each kind before ``trial`` chooses (after one untimed step of each)

    def __init__(self, model, cache=True, graph=_blocks_and_head, backend=None):
        self.model, self.backend, self._cache_arg, self._verifier = model, backend, cache, None
        self.trial = None            # ``compile_decode(faster=True)``: batch class -> the times of each kind
        self.chosen = {}             # batch class ("1", "B") -> "eager" or "compiled", once timed
        self.shapes = set()          # a verifier's (B, T) seen
        # dynamo keeps compiled graphs per code object, so each model gets a copy of the function's code: its own
        # cache and recompile limit, and no guard scan over other models' graphs
        code = graph.__code__.replace()
        own = types.FunctionType(code, graph.__globals__, graph.__name__)
        self.graph = torch.compile(own, dynamic=DYNAMIC, options=OPTIONS)
        self.cache = cache_dir(cache)
        self.fallback = None if self.cache is not None else "cache=False"
        self.graphs = []             # precompiled graphs, each taken where its guards accept the call
        self.loaded = self.compiled = 0
        self._fullgraph = torch.compile(own, dynamic=DYNAMIC, fullgraph=True, options=OPTIONS)
        self._key = None

    def __call__(self, tokens, state):
        if self.trial is None:
            return self._compiled(tokens, state)
        key = "1" if tokens.shape[0] == 1 else "B"
        if key in self.chosen:
            return self._compiled(tokens, state) if self.chosen[key] == "compiled" else self._eager(tokens, state)
        return self._timed(key, tokens, state)

    @torch.no_grad()
    def _eager(self, tokens, state):
        return self.model.eager_step(tokens, state)     # as the graph runs: a trial times the two alike

    def _timed(self, key, tokens, state):
        """One step of ``compile_decode(faster=True)``'s trial at batch class ``key``: compiled and eager in turn,
        the first of each untimed (the graph built or loaded; the eager kernels' calls planned), then TRIAL of
        each timed; the faster by its best time is kept (the eager one on a tie: the reference)."""
        times = self.trial.setdefault(key, {"compiled": [], "eager": [], "calls": 0})
        n = times["calls"]
        times["calls"] += 1
        kind = "compiled" if n % 2 == 0 else "eager"
        start = time.perf_counter()
        out = self._compiled(tokens, state) if kind == "compiled" else self._eager(tokens, state)
        if n >= 2:
            times[kind].append(time.perf_counter() - start)
        if min(len(times["compiled"]), len(times["eager"])) >= self.TRIAL:
            best = {k: min(times[k]) for k in ("compiled", "eager")}
            self.chosen[key] = "compiled" if best["compiled"] < best["eager"] else "eager"
            log.info("compile_decode: %s row%s: eager %.2f ms, compiled %.2f ms: %s", "one" if key == "1" else
                     "several", "" if key == "1" else "s", 1e3 * best["eager"], 1e3 * best["compiled"],
                     self.chosen[key])
        return out

    @torch.no_grad()
    def _compiled(self, tokens, state):
        model = self.model
        h, pos = model._embed_tokens(tokens, state)       # without autograd, as the graph runs (``_for_graph``)
        t = tokens.shape[1]
        if self.backend is not None:
            self.shapes.add(tuple(tokens.shape))
        states = [None] * len(model.blocks) if state is None else [{k: _for_graph(v, t) for k, v in s.items()}
                                                                    for s in state]
        # no duck sizing: a batch of 3 beside a convolution's 3-token tail would tie the two sizes (a recompile)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch.fx.experimental._config.patch(use_duck_shape=False), \
                (sequence.use(self.backend) if self.backend is not None else contextlib.nullcontext()):
            graph = self._precompiled(h, states, tokens) if self.fallback is None else None
            logits, out = (graph or self.graph)(model, h, states, tokens)
        return logits, ModelState(out, pos=pos)

    def verifier(self) -> "CompiledStep":
        """The compiled verification of speculative decoding (``models.speculative.verify``; module doc): tokens
        (B, T), state -> (logits (B, T, vocab), the state with each "states" part's entries kept after every
        token, (B, T, ...), and KV caches appended). A graph per (batch 1 or more, T), built at its first call -
        minutes for a large model (its recurrences unrolled T times) - or loaded from the cache."""
        if self._verifier is None:
            from subquad.layers.rollback import PER_TOKEN

            self._verifier = CompiledStep(self.model, self._cache_arg, _blocks_and_heads, PER_TOKEN)
        return self._verifier


    def _precompiled(self, h, states, tokens):
        """The saved or precompiled graph whose guards accept this call: one already here, else the cache's
        file for the call's specialisation, else one compiled now and saved; None when the model cannot be
        compiled whole (``fallback`` says why, and the step stops trying)."""
        model = self.model
        for g in self.graphs:
            if g.guard_check(model, h, states, tokens):
                return g
        if len(self.graphs) >= RECOMPILE_LIMIT:
            self.fallback = f"{RECOMPILE_LIMIT} graphs, none of whose guards accept the call"
            return None
        if self._key is None:
            self._key = cache_key(model)
        spec = hashlib.sha256(_specialisation(h, states).encode()).hexdigest()[:16]
        path = self.cache / f"{self._key}-{spec}.bin"
        g = self._load(path)
        CompiledStep.made += 1
        if g is not None and g.guard_check(model, h, states, tokens):
            self.loaded += 1
        else:
            # the saved guards pickle the model's attributes: not this step (its graphs' guards do not pickle)
            held = model.__dict__.pop("_decode_step", None)
            try:
                with torch._dynamo.config.patch(specialize_float=True):
                    g = self._fullgraph.aot_compile(((model, h, states, tokens), {}))
            except Exception as e:  # noqa: BLE001 - a graph break, an op aot_compile cannot save: torch.compile's graphs
                self.fallback = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.info("compile_decode: %s runs torch.compile's graphs, not cached (%s)", type(model).__name__,
                         self.fallback)
                return None
            finally:
                if held is not None:
                    model._decode_step = held
            self.compiled += 1
            self._save(g, path)
        g.disable_guard_check()          # checked here, before each call
        self.graphs.append(g)
        return g

    @staticmethod
    def _load(path):
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as e:  # noqa: BLE001 - any unreadable file: compile instead
            warnings.warn(f"compile_decode: ignoring an unreadable saved graph {path} ({type(e).__name__}: {e}); "
                          "compiling it again", stacklevel=3)
            return None

    @staticmethod
    def _save(g, path):
        """Write ``g`` to ``path`` through a temporary file and a rename: a reader sees a whole file or none."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(type(g).serialize(g).serialized_data)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a read-only or full disk: the step still runs, the next process compiles
            warnings.warn(f"compile_decode: could not save the compiled step to {path} ({type(e).__name__}: {e})",
                          stacklevel=3)


def compile_decode(model, on: bool = True, cache=True, faster: bool = False):
    """Make ``model.step`` (and so ``generate``) run the compiled step (module doc), or eager with ``on=False``;
    returns the model. The first steps compile (seconds for a small model, longer for a large one) unless a
    process on this machine saved the same graphs before: ``cache`` True (``cache_dir``), a folder, or False
    (compile in this process only). ``faster``: each batch class (one row; more) then times the eager and the
    compiled step against each other over its first steps and keeps the faster (``CompiledStep.chosen``) - the
    eager step's C kernels beat the graph for Mamba, Mamba-2 and hybrid blocks on the hosts measured
    (benchmarks/RESULTS.md, "Eager against compiled"); the CLI's ``--compile-decode`` asks for it."""
    if not isinstance(on, bool):
        raise ValueError(f"compile_decode's on must be a bool, got {on!r}")
    if not isinstance(cache, (bool, str, os.PathLike)):
        raise ValueError(f"compile_decode's cache must be a bool or a folder, got {cache!r}")
    if not isinstance(faster, bool):
        raise ValueError(f"compile_decode's faster must be a bool, got {faster!r}")
    model._decode_step = CompiledStep(model, cache) if on else None
    if on and faster:
        model._decode_step.trial = {}
    return model


def decode_layout(model):
    """Store every wide matrix of ``model`` (out_features >= 2 in_features: input projections, the vocabulary
    head or the tied embedding; an untied embedding is only looked up and keeps its rows) column-major, and
    return the model. Same shapes, values and state dict.
    Decoding one token reads each weight in a matrix-vector product, which CPU BLAS streams faster from the
    column-major layout; prefill and training run at the same speed either way. float32 weights only: for
    bfloat16 weights the row-major layout is the faster one, and so it is for the matrices oneDNN multiplies
    (``layers.linear``: 27.6 against 32.7 ms per compiled step at mamba-130m's shape), which stay as they are.
    ``from_pretrained`` applies it."""
    from subquad.layers.linear import MIN_WEIGHTS, ONEDNN

    tied = getattr(model, "head", None) is None            # the embedding is the head's matrix too
    for m in model.modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            continue                                   # (a quantised module's ``weight`` is a dequantised copy)
        w = m.weight
        if isinstance(m, nn.Embedding) and not tied:
            continue                                   # looked up a row at a time: row-major serves it best
        if w is not None and w.dim() == 2:
            wide = w.shape[0] >= 2 * w.shape[1]            # Linear: (out, in); Embedding: (vocab, d_model)
            onednn = ONEDNN and w.numel() >= MIN_WEIGHTS and w.device.type == "cpu"   # reads row-major best
            if wide and w.is_contiguous() and w.dtype == torch.float32 and not onednn:
                m.weight = nn.Parameter(w.detach().T.contiguous().T, requires_grad=w.requires_grad)
    forget_block_steps(model)
    return model
