"""Synthetic tasks, one per file."""

from subquad.tasks.mqar import answer_accuracy, mqar
from subquad.tasks.passkey import passkey_prompt, passkey_sweep

__all__ = ["mqar", "answer_accuracy", "passkey_prompt", "passkey_sweep"]
