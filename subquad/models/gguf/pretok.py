"""How a byte-level BPE splits text before its merges, by the name GGUF files give it (``tokenizer.ggml.pre``).

llama.cpp's converter names a tokenizer's pre-tokenizer ("qwen2", "llama-bpe", "gpt-2", ...: the hash of its
output on a test text, ``get_vocab_base_pre``) and ``src/llama-vocab.cpp`` maps the name to its regexes. The
Hugging Face tokenizer.json of the same model holds the regex itself: a ``Split`` (behaviour "Isolated") before a
``ByteLevel`` that only maps bytes (``use_regex`` false), or one ``ByteLevel`` whose own regex is GPT-2's.

    name (and its aliases)               regexes (each splits the pieces of the one before; unmatched text
                                         stays a piece)                          merges ignored for whole words
    gpt-2, olmo, mpt, phi-2, ...         GPT-2's (ByteLevel's own)              no
    llama-bpe, llama3, falcon-h1, lfm2   Llama 3's: digits in threes             yes (llama.cpp's ignore_merges)
    smaug-bpe, dbrx                      Llama 3's                               no
    qwen2, deepseek-r1-qwen, megrez      Qwen2's: single digits                  no
    qwen35                               Qwen3.5's: marks kept with letters      no
    starcoder, smollm, refact, ...       single digits, then GPT-2's             no
    bailingmoe, bailingmoe2              Ling's                                  no
    deepseek-v3                          digits in threes, CJK runs, then its own
    gpt-4o, llama4, minimax-m2           o200k's: case-aware words, digits in threes
    default (or no name)                 llama.cpp's fallback: punctuation runs, GPT-2's, digit runs, threes

The regexes are the tokenizer.json originals (llama.cpp rewrites ``(?i:...)`` and possessive quantifiers for its
own engine; Oniguruma, which ``tokenizers`` uses, reads them as written). ``pre_tokenizer(name)`` builds the
``tokenizers`` pre-tokenizer of a name (reading a GGUF file without tokenizer.json); ``pre_name(spec)`` finds the
name of a tokenizer.json's (writing one), None where no name here splits that way.
"""

from __future__ import annotations

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LING = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# name -> (regexes before the byte mapping, or None: ByteLevel's own GPT-2 regex; ignore_merges)
# (the first name of each group is the one written)
_GROUPS = [
    (("gpt-2", "olmo", "mpt", "phi-2", "jais", "trillion", "granite-docling", "exaone4", "jina-es", "jina-de",
      "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "a.x-4.0", "mellum",
      "modern-bert"), None, False),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     (LLAMA3,), True),
    (("smaug-bpe", "dbrx"), (LLAMA3,), False),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "hunyuan", "solar-open"), (QWEN2,), False),
    (("qwen35",), (QWEN35,), False),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     (r"\p{N}", GPT2), False),
    (("bailingmoe2", "bailingmoe", "llada-moe"), (LING,), False),
    (("deepseek-v3",), DEEPSEEK3, False),
    (("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"), (GPT4O,), False),
    (("default",), DEFAULT, False),
]
SPLITS = {name: (regexes, ignore) for names, regexes, ignore in _GROUPS for name in names}


def pre_tokenizer(name: str | None):
    """(the ``tokenizers`` pre-tokenizer of GGUF pre-tokenizer ``name``, whether merges are ignored for a piece
    that is a token), or None for a name not in the table. No name is llama.cpp's "default"."""
    from tokenizers import Regex, pre_tokenizers

    regexes, ignore = SPLITS.get(name or "default", (False, False))
    if regexes is False:
        return None
    if regexes is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False), ignore
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), ignore


def _regexes(pre: dict) -> tuple | None:
    """The split regexes of a tokenizer.json pre-tokenizer (None: ByteLevel's own), or False where it is not a
    byte-level split that a GGUF name can say (another pre-tokenizer, a prefix space, another behaviour)."""
    if pre.get("type") == "ByteLevel":
        return None if pre.get("use_regex", True) and not pre.get("add_prefix_space", False) else False
    if pre.get("type") != "Sequence":
        return False
    *splits, last = pre.get("pretokenizers") or [{}]
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space", False):
        return False
    out = []
    for s in splits:
        if s.get("type") == "Digits" and s.get("individual_digits"):
            out.append(r"\p{N}")
        elif s.get("type") == "Split" and s.get("behavior") == "Isolated" and not s.get("invert") \
                and isinstance(s.get("pattern"), dict) and "Regex" in s["pattern"]:
            # a tokenizer.json may hold a regex's CR and LF as the characters themselves (DeepSeek-V3's)
            out.append(s["pattern"]["Regex"].replace("\r", "\\r").replace("\n", "\\n"))
        else:
            return False
    if last.get("use_regex", True):
        if not out:
            return None                                      # ByteLevel alone, in a Sequence
        out.append(GPT2)
    return tuple(out) if out else False


def pre_name(spec: dict) -> str | None:
    """The GGUF pre-tokenizer name of tokenizer.json ``spec`` (module doc), or None where none splits as it does."""
    regexes = _regexes(spec.get("pre_tokenizer") or {})
    if regexes is False:
        return None
    ignore = bool((spec.get("model") or {}).get("ignore_merges", False))
    for names, theirs, ignores in _GROUPS:
        if theirs == regexes and (ignores == ignore or regexes is None):
            return names[0]
    return None
