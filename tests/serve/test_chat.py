"""Chat templates render as transformers' apply_chat_template renders them (its whitespace rules, loop
controls, raise_exception, tojson and special tokens), and a template's refusal is a ValueError."""

import json

import pytest

from subquad.serve.chat import ChatTemplate, TemplateError, load_chat_template

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
