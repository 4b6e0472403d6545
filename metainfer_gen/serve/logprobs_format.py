"""The ``logprobs`` of OpenAI's answers, from the engine's :class:`~metainfer_gen.llm.logits_processors.TokenLogprobs`.

Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps token text to logprob and holds the sampled token as well (as vLLM does). Chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``.
Token texts are each token decoded alone.
"""

from __future__ import annotations


class LogprobsFormatter:
    """Formats one answer's logprobs with ``tokenizer`` (a transformers tokenizer); ``chat`` picks the shape."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def format(self, entries: list, text_offset: int = 0) -> dict:
        """The ``logprobs`` object of a choice (or a streamed chunk) for ``entries``; ``text_offset``: characters
        of the answer before the first of them (completions' ``text_offset``)."""
        if self.chat:
            return {"content": [self._chat_entry(entry) for entry in entries], "refusal": None}
        tokens = [self._text(entry.token_id) for entry in entries]
        offsets, position = [], text_offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        tops = [{**{self._text(t): v for t, v in entry.top}, token: entry.logprob}
                for entry, token in zip(entries, tokens)]
        return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_entry(self, entry) -> dict:
        token = self._text(entry.token_id)
        return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (text := self._text(t)), "logprob": v, "bytes": list(text.encode())}
                                 for t, v in entry.top]}
