"""Processes for the tests that need several: forked from one server process that imported torch and
subquad once (multiprocessing's forkserver), not spawned interpreters that import them each - seconds per
process under load, and a test of 4 ranks starts 4. The server computes nothing, so a child starts as clean as
a fresh interpreter (no threads, no state from other tests); each child is a process of its own."""

import multiprocessing

PRELOAD = ["torch", "torch.distributed", "pytest", "subquad.models", "subquad.train", "subquad.distributed",
           "subquad.ops"]


def context():
    """The forkserver context, its server preloading ``PRELOAD`` (set before the first start: one server per
    session, shared by every caller)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")
