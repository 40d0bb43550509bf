"""Run a function on W local processes (gloo, file rendezvous) and collect what each returns."""

from subquad.distributed.launch import run_local as run

__all__ = ["run"]
