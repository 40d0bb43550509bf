"""Training: the trainer, evaluation, checkpoints."""

from subquad.train.checkpoint import (CheckpointError, CheckpointWriteError, latest_checkpoint, load_checkpoint,
                                      save_checkpoint)
from subquad.train.parallelize import make_mesh, parallelize
from subquad.train.run import load_run, run_folder, train_run
from subquad.train.trainer import PeerLost, TrainConfig, Trainer, TrainingDiverged, cross_entropy, evaluate

__all__ = ["CheckpointError", "CheckpointWriteError", "latest_checkpoint", "load_checkpoint", "save_checkpoint",
           "TrainConfig", "Trainer", "TrainingDiverged", "PeerLost", "cross_entropy", "evaluate", "train_run",
           "load_run", "run_folder", "make_mesh", "parallelize"]
