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
