"""GGUF vocabularies <-> subquad's tokenizers, as llama.cpp's converter writes them (``conversion/base.py``:
``_set_vocab_gpt2``, ``_set_vocab_rwkv_world``; gguf-py's ``SpecialVocab``) and its ``src/llama-vocab.cpp`` reads
them. ``tokenizer.ggml.model``:

    "gpt2"   a byte-level BPE: ``tokenizer.ggml.tokens`` (byte-level spelled), ``token_type``, ``merges`` ->
             a ``tokenizers.Tokenizer``; padding tokens ``[PAD{id}]`` (type 5, unused) left out; the text split
             before the merges as ``tokenizer.ggml.pre`` names (``gguf.pretok``: "qwen2", "llama-bpe", ...)
    "rwkv"   RWKV's world vocabulary: token 0 ``<s>`` (control), then token i the i-th line of
             ``rwkv_vocab_v20230424.txt`` as the text of ``repr(token bytes)[2:-1]`` (``\\xNN``, ``\\t``,
             ``\\n``, ``\\r``, ``\\\\``, ``\\'`` escapes), padding to the model's rows -> a
             ``data.rwkv_world.WorldTokenizer`` (greedy longest match over the byte strings, as llama.cpp's
             ``llm_tokenizer_rwkv``), ``<s>`` matched in text as token 0 (the special tokens of a
             ``tokenizers.Tokenizer`` are; llama.cpp's trie holds it too). The converter's own ids: bos = eos = 0,
             eot = 261 (``"\\n\\n"``, "to make it chat normally"); its chat template, when the folder has none,
             ``WORLD_TEMPLATE`` (or the name "rwkv-world", llama.cpp's built-in of it, where the template file
             is not beside the converter)

``tokenizer.huggingface.json``, when present (subquad writes it beside "gpt2", and alone for another
``tokenizers`` model), is the whole tokenizer and is read first. ``tokenizer.chat_template`` and the special
tokens' ids are a folder's ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``, ...):
``tokenizer_config`` makes one from the metadata, and ``tokenizer_metadata`` writes a model's back, so a GGUF
file is served and saved as a folder is.
"""

from __future__ import annotations

import json
import re
import warnings

from subquad.data.rwkv_world import WorldTokenizer
from subquad.models.gguf.pretok import pre_name, pre_tokenizer
from subquad.models.hf.common import chat_template_source

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5      # gguf-py's TokenType
WORLD_BOS = "<s>"                                             # the converter's token 0
WORLD_EOT = b"\n\n"                                           # its eot (id 261 in the world vocabulary)
# tokenizer_config.json's special tokens <-> GGUF's ``tokenizer.ggml.{key}_token_id`` (llama.cpp's spelling)
SPECIAL_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding",
                "sep_token": "seperator", "cls_token": "cls", "mask_token": "mask"}
# llama.cpp's models/templates/llama-cpp-rwkv-world.jinja: what the converter writes for an RWKV world folder
# without a chat template of its own
WORLD_TEMPLATE = """{%- if not add_generation_prompt is defined -%}
    {%- set add_generation_prompt = true -%}
{%- endif -%}
{%- set ns = namespace(system_prompt='') -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system_prompt = message['content'] -%}
    {%- endif -%}
{%- endfor -%}
{{bos_token}}
{%- if ns.system_prompt != '' -%}
{{- 'System: ' + ns.system_prompt + '\\n\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}
        {{- 'User: ' + message['content']|trim + '\\n\\n' -}}
    {%- endif -%}
    {%- if message['role'] == 'assistant' and message['content'] is  not none -%}
        {%- set content = message['content'] -%}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {{- 'Assistant: ' + content|trim + '\\n\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'Assistant:' -}}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- ' <think>\\n</think>' }}
    {%- endif %}
    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- ' <think>' }}
    {%- endif %}
{%- endif -%}"""
BUILTIN_TEMPLATES = {"rwkv-world": WORLD_TEMPLATE}     # llama.cpp's named templates subquad renders
# A "gpt2" vocabulary's pre-tokenizer names for which llama.cpp adds a BOS token where the file does not say
# (``tokenizer.ggml.add_bos_token`` absent; llama-vocab.cpp's defaults for BPE vocabularies: else none)
BOS_BY_DEFAULT = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                            "jina-v5-nano", "tekken", "chameleon"})


# ------------------------------------------------------------------------------------------------- RWKV world
def escape_world(token: bytes) -> str:
    """A world token as the converter spells it: ``repr(token)[2:-1]`` (``b'\\xff'`` -> ``\\xff``)."""
    return repr(token)[2:-1]


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.S)
_ESCAPES = {"t": b"\t", "n": b"\n", "r": b"\r"}


def unescape_world(text: str) -> bytes:
    """The bytes of a converter-spelled world token, as llama.cpp's ``llama_unescape_rwkv_token``: ``\\xNN`` a
    byte, ``\\t`` ``\\n`` ``\\r`` those, a backslash before anything else that character."""
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(text):
        out += text[pos:m.start()].encode("utf-8")
        e = m.group(1)
        if e[0] == "x" and len(e) == 3:
            out.append(int(e[1:], 16))
        else:
            out += _ESCAPES.get(e, e.encode("utf-8"))
        pos = m.end()
    return bytes(out + text[pos:].encode("utf-8"))


def world_tokenizer(meta: dict) -> WorldTokenizer:
    """The "rwkv" vocabulary's tokenizer (module doc): normal tokens in the trie, control ones matched as text."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    vocab, special = {}, {}
    for i, t in enumerate(tokens):
        kind = types[i] if i < len(types) else TOKEN_NORMAL
        if kind == TOKEN_CONTROL:
            special[t] = i
        elif kind != TOKEN_UNUSED:
            vocab.setdefault(unescape_world(t), i)
    return WorldTokenizer(vocab, special)


def world_metadata(tok: WorldTokenizer, vocab_size: int) -> dict:
    """``_set_vocab_rwkv_world``'s keys for ``tok`` (ids 1..n, the file's lines) in a model of ``vocab_size``."""
    n = max(tok.id_to_bytes)
    if sorted(tok.id_to_bytes) != list(range(1, n + 1)):
        raise ValueError("the world tokenizer's ids are not 1..n without gaps: the converter writes the "
                         "vocabulary's lines in order after <s>")
    if n + 1 > vocab_size:
        raise ValueError(f"the world tokenizer has {n + 1} tokens with <s>, more than the model's {vocab_size} rows")
    pad = range(n + 1, vocab_size)
    meta = {"tokenizer.ggml.model": "rwkv",
            "tokenizer.ggml.tokens": [WORLD_BOS] + [escape_world(tok.id_to_bytes[i]) for i in range(1, n + 1)]
            + [f"[PAD{i}]" for i in pad],
            "tokenizer.ggml.token_type": [TOKEN_CONTROL] + [TOKEN_NORMAL] * n + [TOKEN_UNUSED] * len(pad),
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    eot = tok.token_to_id(WORLD_EOT.decode())
    if eot is not None:
        meta["tokenizer.ggml.eot_token_id"] = eot
    return meta


# ------------------------------------------------------------------------------------------------- reading
def tokenizer(meta: dict):
    """The tokenizer of GGUF metadata (module doc): ``tokenizer.huggingface.json`` when the file holds one, a
    ``tokenizers.Tokenizer`` for "gpt2", a ``WorldTokenizer`` for "rwkv"; None for other models (SentencePiece
    "llama", ...) or none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if isinstance(meta.get("tokenizer.huggingface.json"), str):     # the whole tokenizer, as subquad writes it
        return Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    if "tokenizer.ggml.tokens" not in meta:
        return None
    if meta.get("tokenizer.ggml.model") == "rwkv":
        return world_tokenizer(meta)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return None
    types = meta.get("tokenizer.ggml.token_type", [])
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if i >= len(types) or types[i] != TOKEN_UNUSED}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    name = meta.get("tokenizer.ggml.pre")
    if name is None:
        warnings.warn("the file names no pre-tokenizer (tokenizer.ggml.pre): text is split as llama.cpp splits it "
                      "then, by its 'default' regexes - which may not be how the model was trained", stacklevel=3)
    split = pre_tokenizer(name)                          # the splitting llama.cpp gives the file's name
    if split is None:
        warnings.warn(f"tokenizer.ggml.pre {name!r} is a pre-tokenizer subquad does not know: text is split as "
                      "GPT-2's byte-level BPE splits it (llama.cpp splits it its own way)", stacklevel=3)
        split = (pre_tokenizers.ByteLevel(add_prefix_space=False), False)
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=split[1]))
    tok.pre_tokenizer = split[0]
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind == TOKEN_CONTROL]
    if special:
        tok.add_special_tokens(special)
    user = [t for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind == TOKEN_USER_DEFINED]
    if user:                                             # matched whole in text, as llama.cpp's user-defined ones
        tok.add_tokens(user)
    _add_bos_eos(tok, meta, name)
    return tok


def _add_bos_eos(tok, meta: dict, pre: str | None):
    """The BOS / EOS tokens llama.cpp adds around a text it tokenises (``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token``, else its default for the pre-tokenizer: ``BOS_BY_DEFAULT``), as the tokenizer's
    post-processor - what a folder's tokenizer.json holds for such a model (``encode(text)`` adds them,
    ``add_special_tokens=False`` does not)."""
    from tokenizers import processors

    tokens = meta["tokenizer.ggml.tokens"]
    ends = {}                                            # "bos" / "eos" -> (its text, its id), where added
    for key, default in (("bos", pre in BOS_BY_DEFAULT), ("eos", False)):
        add, i = meta.get(f"tokenizer.ggml.add_{key}_token"), meta.get(f"tokenizer.ggml.{key}_token_id")
        add = add if isinstance(add, bool) else default  # (llama.cpp reads the flag as a bool only)
        if add and isinstance(i, int) and 0 <= i < len(tokens):
            ends[key] = (tokens[i], i)
    if not ends:
        return
    head = f"{ends['bos'][0]} " if "bos" in ends else ""
    tail = f" {ends['eos'][0]}" if "eos" in ends else ""
    try:
        tok.post_processor = processors.TemplateProcessing(single=f"{head}$A{tail}", pair=f"{head}$A{tail} $B:1{tail}",
                                                           special_tokens=list(dict.fromkeys(ends.values())))
    except Exception as e:                               # a token's text the template syntax cannot hold
        warnings.warn(f"the file's BOS / EOS ({', '.join(t for t, _ in ends.values())}) cannot be added as the "
                      f"tokenizer's template ({e}): prompts are encoded without them", stacklevel=4)


def end_of_generation_ids(meta: dict, vocab_size: int) -> list[int]:
    """The ids generation stops at: eos, eot and eom (llama.cpp's ``is_eog`` set from the metadata), in range."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < vocab_size))


def tokenizer_config(meta: dict, tok) -> dict:
    """The ``tokenizer_config.json`` a folder would hold for this metadata: ``chat_template`` (a llama.cpp
    built-in name subquad knows as its Jinja text; another name is left out, with a warning: it is no template)
    and the special tokens' texts (``tok.decode`` of their ids); {} when there is neither."""
    config = {}
    source = meta.get("tokenizer.chat_template")
    if isinstance(source, str) and source:
        if "{" not in source and source not in BUILTIN_TEMPLATES:
            warnings.warn(f"GGUF tokenizer.chat_template is {source!r}, a name of one of llama.cpp's built-in "
                          "templates, not a Jinja template; subquad knows "
                          f"{', '.join(BUILTIN_TEMPLATES)} only: no chat template", stacklevel=3)
        else:
            config["chat_template"] = BUILTIN_TEMPLATES.get(source, source)
    for name, key in SPECIAL_KEYS.items():
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tok is not None and isinstance(i, int) and 0 <= i:
            text = tok.decode([i], skip_special_tokens=False)
            if text:
                config[name] = text
    return config


# ------------------------------------------------------------------------------------------------- writing
def tokenizer_metadata(tokenizer, vocab_size: int, files: dict | None = None) -> dict:
    """llama.cpp's vocabulary keys for ``tokenizer`` (module doc): a byte-level BPE ``tokenizers.Tokenizer`` as
    "gpt2" (other ``tokenizers`` models as ``tokenizer.huggingface.json`` alone), a ``WorldTokenizer`` as "rwkv".
    ``files``: the model's ``tokenizer_config.json`` / ``chat_template.jinja`` (``model.hf_source``), whose chat
    template and special tokens are written as the converter's ``SpecialVocab`` writes them."""
    if isinstance(tokenizer, WorldTokenizer):
        meta = world_metadata(tokenizer, vocab_size)
    else:
        meta = _bpe_metadata(tokenizer, vocab_size)
    config, source = chat_template_source(files or {})
    for name, key in SPECIAL_KEYS.items():
        text = config.get(name)
        text = text.get("content") if isinstance(text, dict) else text
        i = tokenizer.token_to_id(text) if isinstance(text, str) else None
        if i is not None:
            meta.setdefault(f"tokenizer.ggml.{key}_token_id", i)
    if source is None and isinstance(tokenizer, WorldTokenizer):
        source = WORLD_TEMPLATE
    if source:
        meta["tokenizer.chat_template"] = source
    return meta


def _bpe_metadata(tokenizer, vocab_size: int) -> dict:
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model", {})
    meta = {"tokenizer.huggingface.json": tokenizer.to_str()}
    pre = pre_name(spec) if model.get("type") == "BPE" else None
    if pre is None:
        warnings.warn("the tokenizer is not a byte-level BPE that llama.cpp reads (its pre-tokenizer splits text in a "
                      "way no GGUF name says, or its model is not BPE): the file holds it as tokenizer.huggingface."
                      "json, which subquad reads and llama.cpp does not", stacklevel=4)
        return meta
    # every id the tokenizer has - the model's vocabulary and its added tokens (where Qwen's and Llama 3's special
    # tokens live) - as the converter lists them: added ones control (special) or user-defined, gaps padding
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(by_id)}, more than the model's {vocab_size} embeddings")
    added = {a["content"]: bool(a.get("special")) for a in spec.get("added_tokens", [])}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [TOKEN_UNUSED if i not in by_id else (TOKEN_CONTROL if added[t] else TOKEN_USER_DEFINED) if t in added
             else TOKEN_NORMAL for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,      # llama.cpp splits as it does
                 "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                 "tokenizer.ggml.merges": merges})
    meta.update(_special_affixes(tokenizer))
    return meta


def _special_affixes(tokenizer) -> dict:
    """``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (and their ids) for the tokens the tokenizer adds
    around a text (its post-processor), written always: llama.cpp's defaults differ by pre-tokenizer, so a file
    that does not say could have a BOS added that the model never saw, or lose one it always did."""
    from tokenizers import Tokenizer

    probe = Tokenizer.from_str(tokenizer.to_str())      # without padding or truncation, which would add or cut
    probe.no_padding()
    probe.no_truncation()
    enc = probe.encode("a b")                           # the text's tokens are the ones not marked special
    text = [i for i, special in enumerate(enc.special_tokens_mask) if not special]
    if not text:
        warnings.warn("the tokenizer encodes no text token for 'a b': whether it adds a BOS or EOS is not known; the "
                      "GGUF vocabulary adds neither", stacklevel=5)
        return {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    head, tail = enc.ids[:text[0]], enc.ids[text[-1] + 1:]
    if len(head) > 1 or len(tail) > 1:
        warnings.warn(f"the tokenizer adds {len(head)} tokens before a text and {len(tail)} after it; llama.cpp "
                      "adds at most one BOS and one EOS: the GGUF vocabulary adds neither", stacklevel=5)
        head, tail = [], []
    meta = {"tokenizer.ggml.add_bos_token": bool(head), "tokenizer.ggml.add_eos_token": bool(tail)}
    if head:
        meta["tokenizer.ggml.bos_token_id"] = head[0]
    if tail:
        meta["tokenizer.ggml.eos_token_id"] = tail[0]
    return meta
