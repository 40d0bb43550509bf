"""Small fused CPU kernels written in C (``*.c`` beside this file), built on first use and called through ctypes.

A decoding step of one token spends most of its time outside the large products in a dozen small ops per layer
(a short convolution, two thin products, softplus, the recurrence's update, the gate), each paying PyTorch's
dispatch in eager mode and a parallel region's start in a compiled graph. A kernel here does one such run in
one call. Each has a PyTorch reference (the layer's own step), which also runs wherever the kernel does not:
other devices and dtypes, gradients, and machines where it cannot be built.

Building: the machine's C compiler (``$CC``, else ``cc``) at ``-O3 -march=native -fopenmp`` (never
``-ffast-math``: its start-up code would flush denormals for the whole process), once per source, flags and
CPU, into ``$SUBQUAD_CACHE/kernels`` (default ``~/.cache/subquad/kernels``), written to a temporary name and
renamed, so processes building at once never load half a file. OpenMP comes from the runtime torch loaded (the
same ``libgomp.so.1``), so the kernels and torch's own ops share one thread pool. ``SUBQUAD_KERNELS=0`` turns
every kernel off (the reference path); a failed build warns once and falls back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import re
import subprocess
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def enabled() -> bool:
    """Whether kernels may be used at all (``SUBQUAD_KERNELS`` is not "0")."""
    return os.environ.get("SUBQUAD_KERNELS", "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("SUBQUAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "subquad")
    return Path(root) / "kernels"


@functools.cache
def cpuinfo() -> str:
    """The first processor's lines of ``/proc/cpuinfo`` (vendor, model name, flags), or "" where it cannot be read:
    what the kernels' builds, the quantised paths and the products' choice of library depend on."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().split("\n\n")[0]
    except OSError:
        return ""


def cpu_identity() -> str:
    """What ``-march=native`` (and a compiled graph, ``models.decode``) depends on: the CPU's model and flags."""
    keep = [line for line in cpuinfo().splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) if keep else platform.processor()


def _texts(src: Path, seen=None) -> list[str]:
    """The text of ``src`` and of every file it includes with quotes (``#include "common.h"``), each once."""
    seen = set() if seen is None else seen
    if src.name in seen:
        return []
    seen.add(src.name)
    text = src.read_text()
    out = [text]
    for inc in re.findall(r'^#include "([^"]+)"', text, flags=re.M):
        out += _texts(HERE / inc, seen)
    return out


def build(name: str) -> Path:
    """The shared library of ``name.c``, compiled now unless the cache holds it; RuntimeError if it fails."""
    src = HERE / f"{name}.c"
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([*_texts(src), cc, *FLAGS, cpu_identity()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, f"-I{HERE}", str(src), "-o", tmp, "-lm"], capture_output=True, text=True,
                           timeout=120)
        if r.returncode:
            raise RuntimeError(f"{cc} could not build {src.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load(name: str):
    """``name``'s library (ctypes.CDLL), or None when kernels are off or it cannot be built (warned once)."""
    if not enabled():
        return None
    try:                    # torch is imported: its libgomp is the OpenMP runtime the kernel binds to
        return ctypes.CDLL(str(build(name)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"subquad: the fused kernel {name!r} is not available ({e}); the PyTorch step runs instead",
                      RuntimeWarning, stacklevel=2)
        return None


class Kernel:
    """The C function ``name`` of ``library.c`` (default ``name.c``) with ctypes ``argtypes``; called with tensors
    (their data pointers), None (NULL) and numbers. ``available()`` builds it on the first ask and remembers."""

    def __init__(self, name: str, argtypes: list, library: str | None = None):
        self.name, self.argtypes, self.built, self.f = name, argtypes, [], None
        self.library = library or name

    def available(self) -> bool:
        if not self.built:
            self.built.append(self._function() is not None)
        return self.built[0]

    def _function(self):
        if self.f is None:
            lib = load(self.library)
            if lib is None:
                return None
            self.f = getattr(lib, self.name)
            self.f.restype, self.f.argtypes = None, self.argtypes
        return self.f

    def __call__(self, *args):
        """Run it (it must be available)."""
        (self.f or self._function())(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))


def usable(kernel: Kernel, x: torch.Tensor, *tensors) -> bool:
    """Whether a decoding step's ``kernel`` may run on x (B, 1, .): float32 on CPU like every tensor given, no
    gradient, no autocast (the products' outputs would be bfloat16), kernels on, the kernel built, and not
    while tracing: in a compiled step inductor fuses the same ops itself, faster than the custom op called from
    the graph (benchmarks/RESULTS.md, "Fused decoding steps in C"), and no graph then depends on whether a
    kernel happens to be built yet."""
    if torch.compiler.is_compiling():
        return False
    if x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 or not x.is_cpu \
            or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or not enabled():
        return False
    if not all(t is None or (t.dtype == torch.float32 and t.is_cpu) for t in tensors):
        return False
    return kernel.available()


def prompt_usable(kernel: Kernel, tensors, unit_stride=()) -> bool:
    """Whether a prompt's ``kernel`` (a whole prefill in one call: the selective scan, the short convolution) may
    run: every one of ``tensors`` (None skipped) float32 on CPU, those of ``unit_stride`` with unit stride along
    their last axis, no gradient wanted, no autocast, kernels on and built, and not while tracing (a compiled
    graph keeps the torch form, which inductor fuses)."""
    if torch.compiler.is_compiling() or not enabled():
        return False
    tensors = [t for t in tensors if t is not None]
    if any(t.dtype != torch.float32 or not t.is_cpu for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if torch.is_autocast_enabled("cpu") or any(t.stride(-1) != 1 for t in unit_stride if t is not None):
        return False
    return kernel.available()


class Call:
    """``kernel`` with every argument but a few converted once: a decoding step passes a layer the same weights
    and sizes at every token, and converting ~35 arguments (data pointers, numbers) costs ~10 us a call.
    ``args`` holds the fixed values (their tensors kept alive here) and anything at ``slots``, the positions each
    call fills, in order: ``call(*values)``."""

    def __init__(self, kernel: Kernel, args: list, slots: tuple):
        self.f, self.keep, self.slots = kernel._function(), args, slots
        self.raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]

    def __call__(self, *values):
        raw = self.raw.copy()
        for i, v in zip(self.slots, values):
            raw[i] = v.data_ptr() if isinstance(v, torch.Tensor) else v
        self.f(*raw)


def once_per_span(check):
    """A method ``check(self) -> bool`` run in full outside a ``steady`` span and once per span inside one: a True
    found in a span is kept on the object (``_span_seen``) until the span renews (``Held.valid``,
    ``models.stack.Plan.still``)."""
    @functools.wraps(check)
    def checked(self) -> bool:
        mark = steady_mark()
        if mark is not None and getattr(self, "_span_seen", None) is mark:
            return True
        if not check(self):
            return False
        self._span_seen = mark
        return True
    return checked


class Held:
    """What ``modules``' trees hold now, to tell cheaply later whether a ``Call`` built from ``tensors`` (found in
    them) still reads what they hold: every parameter and buffer slot the same tensor (or still None: a bias
    added later counts) with the same data pointer (``.data =`` swaps it), every submodule the same object (a
    replaced projection, a quantised one); a tensor made from one of them (``derive``) by its source, which must
    also keep its version. ``ok``: each of ``tensors`` was found (else nothing may be cached)."""

    def __init__(self, modules, tensors):
        # the storages read now, kept alive: within a ``steady`` span a weight swapped unseen (``.data =``) is then
        # read stale, never freed memory
        self.storages = [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]
        sources = [source(t) for t in tensors]                              # a derived copy is held by its source
        want = {id(t if s is None else s) for t, s in zip(tensors, sources) if t is not None}
        self.versions = [(s, version(s)) for s in sources if s is not None]  # the source edited in place
        self.refs, self.sizes, found = [], [], set()
        for root in modules:
            for mod in root.modules():
                for d in (mod._parameters, mod._buffers, mod._modules):
                    self.sizes.append((d, len(d)))          # a slot added later (a bias) changes its size
                    for name, t in d.items():
                        ptr = t.data_ptr() if isinstance(t, torch.Tensor) else None
                        self.refs.append((d, name, t, ptr))
                        found.add(id(t))
        self.ok = want <= found

    @once_per_span
    def valid(self) -> bool:
        """Whether nothing it holds changed: checked in full, or once per ``steady`` span."""
        for d, n in self.sizes:
            if len(d) != n:
                return False
        for d, name, obj, ptr in self.refs:
            if d.get(name) is not obj or (ptr is not None and obj.data_ptr() != ptr):
                return False
        for t, v in self.versions:
            if version(t) != v:
                return False
        return True


_LOCAL = threading.local()


class Steady:
    """A span of decoding steps in one thread between which only subquad's own decoding code runs: within it a
    ``Held`` (and ``models.stack``'s plan of a run of blocks) checked once is not checked again until ``renew()``
    (call it after any other code ran - a callback - that might have replaced or edited a module, its weights or
    hooks). The check reads every weight's tensor for its data pointer and every module's slots: after a token's
    weights have streamed through the caches each of those reads goes to memory, ~0.5 ms a token of an 8-bit
    mamba-130m or ~1 ms of a hybrid, 7-10% of the step (benchmarks/RESULTS.md, "Checks once per span").
    Edits made by another thread during a span are not seen until it renews."""

    def __init__(self):
        self.mark = object()

    def renew(self) -> None:
        self.mark = object()


@contextlib.contextmanager
def steady(span: Steady | None = None):
    """``with steady() as span:`` a ``Steady`` span for this thread - a new one, or ``span`` entered again (the
    serving engine keeps one across its plain steps) - (``generate`` decodes in one, renewing it after each
    ``on_token``); the previous span (or none) again after it."""
    prev = getattr(_LOCAL, "steady", None)
    span = _LOCAL.steady = Steady() if span is None else span
    try:
        yield span
    finally:
        _LOCAL.steady = prev


def steady_mark():
    """The current ``Steady`` span's mark in this thread, or None outside one."""
    span = getattr(_LOCAL, "steady", None)
    return None if span is None else span.mark


_LOADS: dict[int, int] = {}     # an inference tensor's data pointer -> load_state_dict calls that wrote into it


def version(t: torch.Tensor) -> int:
    """t's in-place version counter. An inference tensor (made under ``torch.inference_mode``: a model loaded or
    quantised there) keeps none and raises on ``_version``: for it -1 less the ``load_state_dict`` calls that
    wrote into it in place (``loaded_in_place``, the hook of the modules whose weights kernels read copies of),
    its data pointer telling a swap. (Other in-place edits of an inference tensor stay unseen.)"""
    try:
        return t._version
    except RuntimeError:
        return -1 - _LOADS.get(t.data_ptr(), 0)


def loaded_in_place(module, incompatible_keys=None) -> None:
    """A ``load_state_dict`` post-hook (``register_load_state_dict_post_hook``): the inference tensors of
    ``module`` may now hold other values in the same storage - their ``version`` moves on, so the copies made
    from them (``derived``: AMX tiles, a column-major dt_proj) and the kept calls holding those are made again."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.is_inference():
            _LOADS[t.data_ptr()] = _LOADS.get(t.data_ptr(), 0) + 1


def derive(copy: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Mark ``copy`` as a tensor a kernel reads in place of the module tensor ``src`` (AMX tiles of an int8 weight:
    ``qgemv.amx_packed``): ``Held`` looks for ``src`` in the modules and holds the copy valid while ``src`` is the
    same tensor with the same storage and version."""
    copy._subquad_source = src
    return copy


def derived(cache, key, src: torch.Tensor, make) -> torch.Tensor:
    """``make(src)``, ``derive``d from the module tensor ``src``, made once per storage and version of src and kept
    in ``cache[key]`` (as (src's data pointer and version, the copy)): a weight in the layout a kernel reads
    (``qgemv.amx_packed``'s tiles, ``layers.mamba.dt_columns``' column-major copy)."""
    now = (src.data_ptr(), version(src))
    hit = cache.get(key)
    if hit is not None and hit[0] == now:
        return hit[1]
    copy = derive(make(src), src)
    cache[key] = (now, copy)
    return copy


def source(t: torch.Tensor):
    """The module tensor ``t`` was derived from (``derive``), or None."""
    return getattr(t, "_subquad_source", None)


class KeptCalls:
    """Calls built once and kept between decoding tokens, per module and key (rows, tokens), each with the norm it
    follows and a ``Held`` of what it read - a layer's ``planned_block``, an MLP's and an attention layer's call
    (``layers.mamba``, ``layers.mlp_step``, ``layers.attention_step``). Kept outside the modules (weak mappings),
    so copies and pickles of a model carry none; ``forget`` drops a model's from every instance (``ALL``) when its
    weights are replaced (``quantize``, ``decode_layout``)."""

    ALL: list = []

    def __init__(self):
        self.by = weakref.WeakKeyDictionary()
        KeptCalls.ALL.append(self)

    def get(self, module, norm, key, build):
        """(``Held``, step, whether it was kept) for ``module`` after ``norm`` at ``key``: the kept step while
        everything it read is unchanged, else ``build()``'s (None: none applies), kept where its tensors were
        found in the modules; steps gone stale at any key are dropped (their old weights freed)."""
        plans = self.by.get(module)
        if plans is None:
            plans = self.by[module] = {}
        hit = plans.get(key)
        if hit is not None and hit[0] is norm and hit[1].valid():
            return hit[1], hit[2], True
        for k in [k for k, (_, held, _) in plans.items() if not held.valid()]:
            del plans[k]
        step = build()
        if step is None:
            return None
        held = Held([module, norm], step.tensors)
        if held.ok:
            plans[key] = (norm, held, step)
        return held, step, False

    def peek(self, module, norm, key):
        """(``Held``, step) kept for ``module`` after ``norm`` at ``key`` (valid or not), or None."""
        plans = self.by.get(module)
        hit = None if plans is None else plans.get(key)
        return None if hit is None or hit[0] is not norm else hit[1:]

    @classmethod
    def forget(cls, modules) -> None:
        modules = list(modules)
        for kept in cls.ALL:
            for m in modules:
                kept.by.pop(m, None)
