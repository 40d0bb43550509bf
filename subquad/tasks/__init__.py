"""Synthetic tasks, one per file."""

from subquad.tasks.mqar import answer_accuracy, mqar

__all__ = ["mqar", "answer_accuracy"]
