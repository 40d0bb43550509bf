"""llama.cpp's ``convert_hf_to_gguf.py`` for a benchmark folder that has no tokenizer files.

    python benchmarks/llama_convert.py LLAMA_SRC FOLDER --outfile X.gguf --outtype f32

The benchmark folders hold random weights at real shapes and no tokenizer (nothing is downloaded), and
llama.cpp's converter reads the vocabulary from the folder's tokenizer for most model types (Mamba's is
the exception: without tokenizer files it writes its built-in GPT-NeoX vocabulary). Here every other model
type does what Mamba's does - the built-in GPT-NeoX vocabulary, padded to the model's ``vocab_size`` with unused
``[PADi]`` tokens as the converter pads a short tokenizer - and the rest of the conversion is llama.cpp's
own. The vocabulary changes no weight and no computation: the benchmark feeds token ids.

The folders are written by transformers 5, whose configs name layer kinds as its own classes do; the
converter (llama.cpp as vendored by llama-cpp-python 0.3.36) reads the names of the released configs.
Read as written, it takes Granite 4's "full_attention" layers and Nemotron-H's "mlp" layers for Mamba
layers, and a dense Nemotron-H for its MoE variant (transformers 5 writes the MoE fields' defaults).
``released_names`` gives it the released configs' fields: Granite 4's ``layer_types`` as "mamba" /
"attention", Nemotron-H's ``hybrid_override_pattern`` string (M, *, -, E) and, when dense, no MoE fields.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


NEMOTRON_PATTERN = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                    "moe": "E"}


MTP_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
NEMOTRON_MOE = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group", "norm_topk_prob",
                "routed_scaling_factor", "moe_shared_expert_overlap")


def released_names(config: dict) -> dict:
    """The config as the released checkpoints' config.json states it (module doc)."""
    kind = config.get("model_type")
    if kind == "granitemoehybrid" and config.get("layer_types"):
        names = {"full_attention": "attention", "linear_attention": "mamba"}
        return {**config, "layer_types": [names.get(t, t) for t in config["layer_types"]]}
    if kind == "nemotron_h" and isinstance(config.get("layers_block_type"), list) \
            and not config.get("hybrid_override_pattern"):
        config = {**config, "hybrid_override_pattern": "".join(NEMOTRON_PATTERN[t] for t in config["layers_block_type"])}
        if "E" not in config["hybrid_override_pattern"]:       # dense: the released config has no MoE fields
            config = {k: v for k, v in config.items() if k not in NEMOTRON_MOE}
    return config


def main():
    src, argv = Path(sys.argv[1]), sys.argv[2:]
    script = src / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(src), str(src / "gguf-py")]     # sys.path[0]: the converter finds models/ there
    import gguf
    from conversion.base import ModelBase
    from conversion.granite import GraniteHybridModel
    from conversion.mamba import Mamba2Model, MambaModel
    # these fall back to the built-in vocabulary themselves
    own = (MambaModel.set_vocab, Mamba2Model.set_vocab, GraniteHybridModel.set_vocab)

    def builtin_vocab(self):
        n = int(self.hparams["vocab_size"])
        w = self.gguf_writer
        tokens, types = w.add_token_list, w.add_token_types
        w.add_token_list = lambda t: tokens(list(t) + [f"[PAD{i}]".encode() for i in range(len(t), n)])
        w.add_token_types = lambda t: types(list(t) + [gguf.TokenType.UNUSED] * (n - len(t)))
        try:
            self._set_vocab_builtin("gpt-neox", n)
        finally:
            del w.add_token_list, w.add_token_types

    init = ModelBase.__init__

    def patched_init(self, dir_model, *args, **kwargs):
        init(self, dir_model, *args, **kwargs)
        if type(self).set_vocab not in own and not any((Path(dir_model) / f).is_file() for f in TOKENIZER_FILES):
            self.set_vocab = builtin_vocab.__get__(self)

    ModelBase.__init__ = patched_init
    load = ModelBase.load_hparams
    ModelBase.load_hparams = staticmethod(lambda *a, **k: released_names(load(*a, **k)))
    mamba2_init = Mamba2Model.__init__

    def mamba2_patched(self, dir_model, *args, **kwargs):     # Mamba-2 models read config.json themselves
        if kwargs.get("hparams") is None:
            kwargs["hparams"] = released_names(json.loads((Path(dir_model) / "config.json").read_text()))
        mamba2_init(self, dir_model, *args, **kwargs)

    Mamba2Model.__init__ = mamba2_patched
    folder = Path(next(a for a in argv if not a.startswith("-")))
    if json.loads((folder / "config.json").read_text()).get("model_type") in MTP_TYPES and "--no-mtp" not in argv:
        argv = [*argv, "--no-mtp"]          # the released checkpoints carry an MTP head, these folders none
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
