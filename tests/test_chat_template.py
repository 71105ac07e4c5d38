"""Chat templates where checkpoints keep them, rendered as transformers renders them."""
import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from kvturn import launch
from kvturn.model.tokenizer import ChatTemplateError, ChatTokenizer

# Uses what real templates use: bos/eos tokens, raise_exception, tools, loop controls, and block tags on lines of
# their own (transformers trims them).
TEMPLATE = """{{ bos_token }}
{% if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'developer' %}
        {{ raise_exception('Developer messages are not supported by this model') }}
    {% endif %}
    {% if message['content'] == 'skip' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "skip"},
     {"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list files ünïcödé", "parameters": {}}}]


def model_dir_with(tiny_model_dir, out, template=None, jinja_file=None):
    """The tiny model with its tokenizer_config.json's chat_template replaced (None: removed) and, optionally, a
    chat_template.jinja beside it."""
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    config["bos_token"] = "<|endoftext|>"
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (out / "chat_template.jinja").write_text(jinja_file)
    return out


@pytest.fixture(scope="module")
def jinja_only_dir(tiny_model_dir, tmp_path_factory):
    return model_dir_with(tiny_model_dir, tmp_path_factory.mktemp("jinja") / "model", jinja_file=TEMPLATE)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_chat_template_jinja_file_renders_as_transformers_renders_it(jinja_only_dir, tools):
    ours, reference = ChatTokenizer(jinja_only_dir), AutoTokenizer.from_pretrained(jinja_only_dir)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tools=tools) == expected
        assert expected.startswith("<|endoftext|>\n<|im_start|>") and "skip" not in expected and "  " not in expected


def test_the_chat_template_jinja_file_wins_over_tokenizer_config(tiny_model_dir, tmp_path):
    both = model_dir_with(tiny_model_dir, tmp_path / "both", template="ignored", jinja_file=TEMPLATE)
    assert ChatTokenizer(both).apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_of_named_templates_in_tokenizer_config_the_default_one_is_used(tiny_model_dir, tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    model = model_dir_with(tiny_model_dir, tmp_path / "named", template=named)
    expected = AutoTokenizer.from_pretrained(model).apply_chat_template(CONVERSATIONS[1], tokenize=False,
                                                                        add_generation_prompt=True)
    assert ChatTokenizer(model).apply_chat_template(CONVERSATIONS[1]) == expected


def test_no_template_and_a_template_refusing_the_messages_raise_a_chat_template_error(tiny_model_dir, tmp_path):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer(model_dir_with(tiny_model_dir, tmp_path / "none")).apply_chat_template(CONVERSATIONS[0])
    model = model_dir_with(tiny_model_dir, tmp_path / "strict", jinja_file=TEMPLATE)
    with pytest.raises(ChatTemplateError, match="Developer messages are not supported"):
        ChatTokenizer(model).apply_chat_template([{"role": "developer", "content": "x"}])


@pytest.mark.integration
def test_a_worker_chats_with_only_a_jinja_file_and_answers_a_refusing_template_with_a_400(jinja_only_dir, tmp_path):
    port = launch.free_port()
    process = launch.start(["worker", "--port", str(port), "--model", str(jinja_only_dir), "--kv-cache-mb", "32",
                            "--no-calibrate"], tmp_path / "worker.log")
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(url, process)
        body = {"messages": CONVERSATIONS[1], "max_tokens": 4, "temperature": 0}
        ok = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        expected = AutoTokenizer.from_pretrained(jinja_only_dir).apply_chat_template(
            CONVERSATIONS[1], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ok.json()["usage"]["prompt_tokens"] == len(expected)
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             json={**body, "messages": [{"role": "developer", "content": "x"}]})
        assert refused.status_code == 400
        assert "Developer messages are not supported" in refused.json()["error"]["message"]
    finally:
        launch.stop(process)
