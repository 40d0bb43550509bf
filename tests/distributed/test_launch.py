"""A rank started by torchrun's agent (``subquad train --nproc``) ends when the agent is killed outright:
``launch.die_with_parent`` (PR_SET_PDEATHSIG). Linux only, as the call."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# the parent starts a child and prints its pid; the child (with "die": after die_with_parent) says it is ready
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = """
import sys, time
if sys.argv[1] == "die":
    from subquad.distributed.launch import die_with_parent
    die_with_parent()
print("ready", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:           # a zombie (reaped by init shortly) counts as gone
        return f.read().split(") ")[-1][0] != "Z"


def _child_after_parent_killed(how: str, wait: float) -> tuple[int, bool]:
    """(the child's pid, whether it is still alive ``wait`` s after its parent got SIGKILL)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, how], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
    finally:
        parent.kill()
        parent.wait(30)
    end = time.monotonic() + wait
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.1)
    return pid, _alive(pid)


def test_a_rank_ends_when_the_process_that_started_it_is_killed():
    pid, alive = _child_after_parent_killed("plain", 1.0)      # the control: without it, the child lives on
    try:
        assert alive
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    pid, alive = _child_after_parent_killed("die", 10.0)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_a_failed_rank_is_one_line_from_the_launcher(monkeypatch, capsys):
    """torchrun raises ChildFailedError, whose text is a ~20-line table; each rank has printed its own error, so
    the launcher says which ranks failed in one line."""
    from types import SimpleNamespace

    import torch.distributed.run as torchrun

    from subquad.distributed.launch import launch

    class Failed(Exception):
        failures = {1: SimpleNamespace(exitcode=2), 0: SimpleNamespace(exitcode=1)}

    def fail(argv):
        raise Failed("Root Cause (first observed failure):\n" * 20)
    monkeypatch.setattr(torchrun, "main", fail)
    assert launch(2, ["train"]) == 1
    assert capsys.readouterr().out == ("error: the distributed run stopped: rank 0 (exit code 1), rank 1 (exit code "
                                       "2) failed (the rank's error is above)\n")


def test_an_error_every_rank_had_is_said_once_with_the_ranks(monkeypatch, capsys):
    """A refusal every rank reaches alike (a bad flag found past argparse, a resume that does not fit) was printed
    once per rank; the ranks leave their one-line errors with the launcher (``rank_error``), which prints each
    distinct one once, naming the ranks that had it, then which ranks failed."""
    from types import SimpleNamespace

    import torch.distributed.run as torchrun

    from subquad.distributed.launch import ERRORS_ENV, launch, rank_error

    class Failed(Exception):
        failures = {0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=2), 2: SimpleNamespace(exitcode=1)}

    def fail(argv):                                     # what the three ranks' processes do
        for rank, message in ((0, "error: the run refuses X"), (1, "error: the run refuses X"),
                              (2, "error: the run refuses X"), (2, "error: rank 2's own")):
            monkeypatch.setenv("RANK", str(rank))
            rank_error(message)
        monkeypatch.delenv("RANK")
        raise Failed("table")
    monkeypatch.setattr(torchrun, "main", fail)
    assert launch(3, ["train"]) == 1
    out = capsys.readouterr()
    assert out.err == "error: the run refuses X (every rank)\nerror: rank 2's own (rank 2)\n"
    assert out.out == ("error: the distributed run stopped: rank 0 (exit code 2), rank 1 (exit code 2), rank 2 (exit "
                       "code 1) failed\n")
    assert ERRORS_ENV not in __import__("os").environ      # the launcher's folder is its own, and gone
    rank_error("error: in one process")                     # not under a launch: on stderr
    assert capsys.readouterr().err == "error: in one process\n"
