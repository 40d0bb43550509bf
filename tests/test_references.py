"""`make test` sets SUBQUAD_REQUIRE_REFERENCES=1: a test that would skip for want of a reference package the
extras install (transformers here, made unimportable) fails instead; without the switch it skips."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("require", ["1", "0"])
def test_a_missing_reference_fails_under_make_test_and_skips_otherwise(tmp_path, require):
    fake = tmp_path / "fake" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('simulated: no transformers', name='transformers')\n")
    (tmp_path / "test_reference.py").write_text(
        "import pytest\n\ntransformers = pytest.importorskip('transformers')\n\n\ndef test_parity():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]),
           "SUBQUAD_REQUIRE_REFERENCES": require}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "test_reference.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if require == "1":
        assert run.returncode != 0 and "SUBQUAD_REQUIRE_REFERENCES=1" in run.stdout, run.stdout
    else:
        assert run.returncode in (0, 5) and "1 skipped" in run.stdout, run.stdout     # 5: no test ran
