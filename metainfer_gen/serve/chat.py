"""Chat messages to prompt token ids: the tokenizer's own chat template, or a small plain one for checkpoints
that ship none (the embedded demo LLM).

The fallback template, :data:`DEFAULT_CHAT_TEMPLATE`, renders

    <bos>system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message and, for the generation prompt, ``assistant:`` with no newline, so the
completion continues that line. The rendered text is tokenized without adding special tokens again (the template
writes BOS itself), as vLLM does for chat prompts.
"""

from __future__ import annotations

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text for ``messages`` (``[{"role", "content"}]`` with string content), ending with the
    assistant's turn."""
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the rendered chat prompt."""
    return list(tokenizer(render_chat(tokenizer, messages), add_special_tokens=False)["input_ids"])
