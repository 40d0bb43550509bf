"""Importing subquad: the process-wide setting it makes, and that a user's own value wins."""

import os
import subprocess
import sys


def _thp_after_import(env_value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    code = "import os, subquad; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_puts_large_tensors_on_huge_pages_unless_the_user_said_otherwise():
    assert _thp_after_import(None) == "1"
    assert _thp_after_import("0") == "0"
