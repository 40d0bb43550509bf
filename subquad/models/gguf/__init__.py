"""GGUF (llama.cpp's file format) in and out, without ggml's ``gguf`` package (the tests' reference).

    model, tokenizer = from_pretrained("model.gguf")            # models.from_pretrained routes .gguf here
    save_gguf(model, "out.gguf", outtype="q8_0")   # f32, f16, bf16, q8_0, q4_0; subquad export --format gguf

    reader.py   the file: metadata, tensor table, tensors (F32/F16/BF16/Q8_0/Q4_0/Q4_K/Q6_K) as views of the map
    arch.py     per architecture (mamba, mamba2, lfm2; qwen.py: qwen3next, qwen35, qwen35moe; qwen4.py: qwen4exp;
                minimax.py: minimax-01; more.py, hybrid.py: the rest, listed by registry.py): llama.cpp's tensor
                names and metadata <-> the Hugging Face checkpoint ``models.hf`` reads, as llama.cpp's converter
                maps them
    load.py     a file -> a LanguageModel (quantised matrices kept as int8 per block, exactly)
    writer.py   a LanguageModel -> a file llama.cpp reads (its converter's names, types and metadata)
    vocab.py    the vocabulary: "gpt2" BPE and RWKV's "rwkv" world vocabulary <-> tokenizers, the chat template and
                special tokens <-> a folder's tokenizer_config.json
"""

from subquad.models.gguf.load import load_gguf
from subquad.models.gguf.writer import save_gguf

__all__ = ["load_gguf", "save_gguf"]
