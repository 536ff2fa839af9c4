"""Roles render exactly as `tokenizer.apply_chat_template` does (what /v1/chat/completions
sends to the model), turn after turn, for several template families; and the client-side
tokenizer gives the server tokenizer's ids."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import radixlm as sgl
from radixlm.backend import Backend, Generation, Prompt
from radixlm.chat_template import ChatRenderer
from radixlm.tokenizer import DirTokenizer, load_client_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
FAMILIES = {
    "smollm2": (None, {}),  # the default model's own template
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2": (QWEN2, {"bos_token": "", "eos_token": "<|im_end|>"}),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}),
}


@pytest.fixture(scope="module")
def default_dir_tokenizer() -> DirTokenizer:
    from radixlm.srt.executor.model_loader import default_model_path, load_model

    tok = load_client_tokenizer(load_model(default_model_path(), with_weights=False).local_dir)
    assert isinstance(tok, DirTokenizer)
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer(default_dir_tokenizer: DirTokenizer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_dir_tokenizer.path)


class EchoBackend(Backend):
    """Records the prompt of every gen and answers with the next scripted reply."""

    def __init__(self, renderer: ChatRenderer, replies: list[str]):
        self.renderer, self.replies, self.prompts = renderer, list(replies), []

    def generate(self, prompt: Prompt, params: Any) -> Generation:
        self.prompts.append(prompt)
        return Generation([self.replies.pop(0)], [{}])

    def generate_stream(self, prompt: Prompt, params: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: Any) -> Any:
        raise NotImplementedError

    def get_chat_template(self) -> ChatRenderer:
        return self.renderer


@sgl.function
def conversation(s, with_system: bool):
    if with_system:
        s += sgl.system("You are terse.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("a1"))
    with s.user():
        s += "And of "
        s += "Spain?"
    s += sgl.assistant_begin() + sgl.gen("a2") + sgl.assistant_end()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("with_system", [True, False])
def test_roles_render_like_apply_chat_template(family, with_system, default_dir_tokenizer, hf_tokenizer):
    template, special = FAMILIES[family]
    if family == "mistral" and with_system:
        pytest.skip("this Mistral template has no system role")
    ours = DirTokenizer(default_dir_tokenizer.path)
    if template is not None:
        ours.chat_template, ours.special_tokens = template, {**ours.special_tokens, **special}

    def reference(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **special)

    # Replies with outer spaces: Llama-3's template trims them, the others keep them.
    backend = EchoBackend(ChatRenderer(ours.apply_chat_template), [" Paris. ", "Madrid."])
    state = conversation.run(with_system, backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == (["system"] if with_system else []) + ["user", "assistant"] * 2
    assert messages[-2]["content"] == "And of Spain?"
    first, second = backend.prompts
    assert first.text == reference(messages[:len(messages) - 3], True)
    assert second.text == reference(messages[:-1], True)
    assert state.text() == reference(messages, False)
    assert second.text.startswith(first.text)  # each turn only appends: the radix cache keeps it


def test_smollm2_default_system_message_is_inserted(default_dir_tokenizer):
    renderer = ChatRenderer(default_dir_tokenizer.apply_chat_template)
    opening = renderer.begin([], "user")
    assert opening.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert opening.endswith("<|im_start|>user\n")
    assert renderer.begin([], "system") == "<|im_start|>system\n"


def test_mistral_template_errors_name_the_roles(default_dir_tokenizer):
    ours = DirTokenizer(default_dir_tokenizer.path)
    ours.chat_template = MISTRAL
    backend = EchoBackend(ChatRenderer(ours.apply_chat_template), ["x"])
    with pytest.raises(ValueError, match=r"rejected the roles \['system'\]: Conversation roles must alternate"):
        conversation.run(True, backend=backend)


def test_client_tokenizer_ids_match_the_server_tokenizer(default_dir_tokenizer, hf_tokenizer):
    texts = ["Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 日本語 🤖",
             "tabs\tand\n\nnewlines  ", "x" * 50 + " 1234567"]
    for text in texts:
        assert default_dir_tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
