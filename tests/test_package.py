"""Importing subquad: the process-wide setting it makes, and that a user's own value wins; what it does not import
(torch._dynamo: ~1.3 s of every process's start); ``outside_graphs``, the lazy ``torch.compiler.disable``."""

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


def test_the_cli_imports_without_dynamo():
    """`subquad --help`, a server, a process that never compiles: torch._dynamo stays unimported
    (``ops.common.precision.outside_graphs`` makes the disabled wrappers at their first call)."""
    code = "import sys, subquad.cli, subquad.models, subquad.serve; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_outside_graphs_runs_the_function_eagerly_under_compile():
    """Traced or not, the first call or a later one: the function runs outside the graph (never while compiling),
    and the compiled function's result equals the eager one."""
    import torch

    from subquad.ops.common.precision import outside_graphs

    seen = []

    @outside_graphs
    def engine(x):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    def f(x):
        return engine(x.sin()) + 1

    torch._dynamo.reset()
    x = torch.randn(5)
    compiled = torch.compile(f)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), f(x))
    assert seen and not any(seen)
    assert engine.__name__ == "engine"
