"""`make test-quick`'s list (tests/quick.txt) names real cases and reaches every test file."""

from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parent


def _listed() -> list[str]:
    return [ln.strip() for ln in conftest.QUICK_LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_every_listed_quick_case_exists():
    # filled at collection for the files collected in this run (all of them under `make test`)
    assert conftest.QUICK_MISSING == [], ("tests/quick.txt names cases that no longer exist; regenerate it with "
                                          f"tests/quick_select.py: {conftest.QUICK_MISSING[:5]}")


def test_every_test_file_has_a_quick_case():
    files = {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("test_*.py")}
    covered = {nid.split("::")[0] for nid in _listed()}
    assert files - covered == set(), f"test files without a case in tests/quick.txt: {sorted(files - covered)}"
    assert covered - files == set(), f"tests/quick.txt names files that do not exist: {sorted(covered - files)}"


class _Case:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_heavy_cases_start_each_workers_share_and_none_is_lost():
    items = [_Case(f"t{i}") for i in range(20)]
    heavy = {"t3": 50.0, "t17": 40.0, "t9": 30.0, "t11": 25.0, "t0": 5.0}
    out = conftest.heavy_first(items, heavy, 2)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items)     # a permutation
    first, second = [i.nodeid for i in out[:10]], [i.nodeid for i in out[10:]]  # xdist's two shares
    # slowest first, each to the lighter share: 50 | 40, 30 -> 40 + 30 = 70 > 50, 25 -> 75 vs 70, 5 -> 70 + 5
    assert first[:2] == ["t3", "t11"] and second[:3] == ["t17", "t9", "t0"]
    light = [i.nodeid for i in items if i.nodeid not in heavy]
    assert first[2:] + second[3:] == light                                      # the rest in collected order


def test_every_heavy_case_exists():
    listed = conftest.read_heavy()
    assert listed and all(s > 0 for s in listed.values())
    assert [n for n in listed if n not in conftest.COLLECTED and n.split("::")[0] in conftest.COLLECTED_FILES] == []
