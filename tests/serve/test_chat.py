"""Chat templates render as transformers' apply_chat_template renders them (its whitespace rules, loop
controls, raise_exception, tojson and special tokens), and a template's refusal is a ValueError."""

import json
import re

import pytest

from subquad.serve.chat import (
    ChatTemplate,
    TemplateError,
    load_chat_template,
    message_ends,
)

TEMPLATES = [
    # ChatML with a default system prompt, trim_blocks/lstrip_blocks-sensitive layout
    """{% if messages[0]['role'] != 'system' %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{% for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}""",
    # Llama-2 style: alternation enforced with raise_exception, bos/eos tokens, loop.index0, tojson
    """{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"""
    """{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"""
    """{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"""
    """{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"""
    """{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ {'n': messages | length} | tojson }}""",
]
MESSAGES = [{"role": "user", "content": " héllo "}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"}]


@pytest.mark.parametrize("source", TEMPLATES)
def test_renders_as_transformers(source, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1},
                                                                                           unk_token="<s>")),
                                               bos_token="<s>", eos_token="</s>")
    want = tok.apply_chat_template(MESSAGES, chat_template=source, tokenize=False, add_generation_prompt=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    assert load_chat_template(tmp_path).render(MESSAGES) == want


def test_a_template_refusal_is_a_value_error(tmp_path):
    t = ChatTemplate(TEMPLATES[1], {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(TemplateError, match="alternate"):
        t.render([{"role": "assistant", "content": "x"}])
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "a"
    with pytest.raises(ValueError, match="compile"):
        ChatTemplate("{% for %}")


def test_message_ends_are_where_each_message_ends_in_the_prompts_tokens():
    """Counted by hand on the ChatML template: after each "<|im_end|>\n\n" (its "\n" and the line break after
    the expression; a character per token here); a
    tokenizer that merges across a message's end gives no boundary there."""
    template = ChatTemplate(TEMPLATES[0])
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"}]
    text = template.render(messages)

    def chars(t):
        return [ord(c) for c in t]

    want = [m.end() for m in re.finditer(re.escape("<|im_end|>\n\n"), text)]
    assert len(want) == 4 and message_ends(template, messages, chars, chars(text)) == want

    def merging(t):                       # "\n<" one token: no message ends exactly on a token
        return [ord(c) for c in t.replace("\n<", "\x00")]

    assert message_ends(template, messages, merging, merging(text)) == []
