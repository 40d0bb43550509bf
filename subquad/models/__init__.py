"""Language models built from any mixer or hybrid pattern; presets; generation; saved states."""

from subquad.models.config import ModelConfig, parse_pattern
from subquad.models.generate import sample
from subquad.models.hf import from_pretrained, save_pretrained
from subquad.models.lm import LanguageModel
from subquad.models.presets import PRESETS, jamba, micro, preset, small
from subquad.models.state import ModelState, load_state, save_state

__all__ = ["ModelConfig", "parse_pattern", "LanguageModel", "ModelState", "sample", "PRESETS", "micro", "small", "jamba",
           "preset", "save_state", "load_state", "from_pretrained", "save_pretrained"]
