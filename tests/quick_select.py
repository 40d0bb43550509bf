"""Choose `make test-quick`'s cases from a timed run: every test file gives its cheapest case, then the cheapest
case of each further test function while the file's share of the budget lasts.

    pytest -n 2 --durations=0 --durations-min=0 > durations.log      # a full, timed run
    python tests/quick_select.py durations.log > tests/quick.txt
    python tests/quick_select.py --heavy durations.log > tests/heavy.txt   # the cases make test starts first

Times are pytest's own (setup + call + teardown per case); a case that did not appear took under its
--durations-min. A module fixture's cost lands on the first case that used it, so a cheap case here may pay
for a fixture in the quick run: check the quick run's time after choosing.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([\d.]+)s\s+(setup|call|teardown)\s+(\S+::\S.*)$")
PER_FILE_S = 1.0            # seconds of one file's cases beyond its first (the whole list: ~1-2 minutes serial)


def read_durations(path: str) -> dict[str, float]:
    """node id -> seconds (setup + call + teardown) from pytest's --durations report."""
    out: dict[str, float] = defaultdict(float)
    for line in open(path, encoding="utf-8", errors="replace"):
        m = LINE.match(line.rstrip("\n"))
        if m:
            out[m.group(3).strip()] += float(m.group(1))
    return dict(out)


def choose(times: dict[str, float], collected: list[str]) -> list[str]:
    """The quick cases of ``collected`` (node ids), by the ``times`` measured (absent: ~0 s)."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for nid in collected:
        by_file[nid.split("::")[0]].append(nid)
    chosen = []
    for f in sorted(by_file):
        cases = sorted(by_file[f], key=lambda n: (times.get(n, 0.0), n))
        seen_fn, spent = set(), 0.0
        for i, nid in enumerate(cases):
            fn = nid.split("[")[0]
            t = times.get(nid, 0.0)
            if i == 0 or (fn not in seen_fn and spent + t <= PER_FILE_S):
                chosen.append(nid)
                seen_fn.add(fn)
                spent += t if i else 0.0
    return chosen


def collect() -> list[str]:
    """Every case pytest collects in tests/ (its --collect-only ids)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, check=True).stdout
    return [ln.strip() for ln in out.splitlines() if "::" in ln]


HEAVY_S = 4.0               # a case at least this long is started first under xdist (tests/conftest.py, heavy_first)


def heavy(times: dict[str, float]) -> str:
    """tests/heavy.txt: the cases of at least ``HEAVY_S`` seconds, slowest first, as "seconds id" lines."""
    lines = ["# make test under pytest-xdist starts these cases first, slowest first, spread over the workers",
             "# (tests/conftest.py, heavy_first); seconds (setup + call + teardown) from a timed run on 2 workers",
             "# (tests/quick_select.py --heavy durations.log > tests/heavy.txt)"]
    lines += [f"{t:.1f} {n}" for n, t in sorted(times.items(), key=lambda x: -x[1]) if t >= HEAVY_S]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--heavy":
        print(heavy(read_durations(sys.argv[2])))
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    times = read_durations(sys.argv[1])
    if not times:
        sys.exit(f"{sys.argv[1]}: no --durations lines (run pytest with --durations=0 --durations-min=0)")
    ids = choose(times, collect())
    total = sum(times.get(i, 0.0) for i in ids)
    print(f"# make test-quick: {len(ids)} cases, {total:.0f} s of test time measured serially "
          f"(tests/quick_select.py; regenerate after adding test files)")
    print("\n".join(ids))
