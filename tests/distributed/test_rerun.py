"""tests/conftest.py's rerun: a multi-process test whose rank dies by a signal runs once more, in a fresh
tmp_path; an ordinary failure is not rerun."""

import os

import pytest

from tests.distributed.helpers import run


def _abort_once(rank, world, marker):
    import torch.distributed as dist

    # both ranks past the process group's connections first: rank 1 aborting while rank 0 still connects made
    # rank 0 raise (gloo's "Connection closed by peer"), an ordinary failure seen before the signal, not rerun
    dist.barrier()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()                                   # SIGABRT, as a C++ library's heap check would
    return rank


def test_a_rank_killed_by_sigabrt_reruns_the_test_in_a_fresh_tmp_path(tmp_path):
    marker = (tmp_path.parent if tmp_path.name == "rerun" else tmp_path) / "aborted"
    assert run(2, _abort_once, str(marker)) == [0, 1]
    assert tmp_path.name == "rerun" and marker.exists()      # the first run aborted; this is the second


def test_a_failed_assertion_in_a_rank_is_not_a_signal(tmp_path):
    """An assertion in a rank arrives as ProcessRaisedException, which the rerun leaves alone."""
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match="rank 1 fails"):
        run(2, _fails, str(tmp_path / "calls"))
    assert tmp_path.name != "rerun"


def _fails(rank, world, calls):
    import torch.distributed as dist

    # as in _abort_once: rank 1 failing while rank 0 still connects made rank 0 raise gloo's "Connection closed
    # by peer" first under load, and that error, not rank 1's, reached the test
    dist.barrier()
    assert rank != 1, "rank 1 fails"
    return rank
