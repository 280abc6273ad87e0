"""Reasoning parsers: split a model's thinking (`<think>...</think>`) from its answer.

`ReasoningParser.extract(text)` splits a whole output into (reasoning_content, content);
`streaming()` gives a `StreamingReasoningParser` whose `feed(delta_text)` returns the
delta's (reasoning, content) parts, holding back only a possible start of a tag. For
structured outputs, `is_reasoning_end(token_ids)` says whether the thinking is over in
those ids (check the prompt's ids at admission, then each new token; vLLM's contract), and
`reasoning_end_token_ids` are the end tag's ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

START, END = "<think>", "</think>"
MAX_HELD_WHITESPACE = 4096  # leading whitespace held while a <think> may follow


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamingReasoningParser:
    """One output's thinking/answer split, fed piece by piece. `in_reasoning` is the
    starting state: True where the prompt opened the thinking (DeepSeek-R1), False where
    the output must open it with `<think>` to think at all (Qwen3)."""

    def __init__(self, in_reasoning: bool) -> None:
        # start (deciding on a leading <think>) | reasoning | content
        self.state = "start"
        self.default = "reasoning" if in_reasoning else "content"
        self.held = ""
        self.thought = False  # a thinking part was seen (reasoning_content is not None)

    @property
    def reasoning_ended(self) -> bool:
        return self.state == "content"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) for this piece of output."""
        reasoning, content = [], []
        buf = self.held + text
        self.held = ""
        if self.state == "start":
            body = buf.lstrip()
            if body.startswith(START):
                buf, self.state, self.thought = body[len(START):], "reasoning", True
            elif START.startswith(body) and len(buf) <= MAX_HELD_WHITESPACE:
                self.held = buf  # maybe <think>: wait
                return "", ""
            else:
                self.state = self.default
                self.thought = self.thought or self.default == "reasoning"
        if self.state == "reasoning":
            p = buf.find(END)
            if p >= 0:
                reasoning.append(buf[:p])
                self.state = "content"
                buf = buf[p + len(END):]
            else:
                keep = _partial(buf, END)
                reasoning.append(buf[:len(buf) - keep])
                self.held = buf[len(buf) - keep:]
                buf = ""
        if self.state == "content":
            content.append(buf)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: what was held back."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "start":
            self.state = self.default
            if self.default == "reasoning":
                self.thought = True
                return held, ""
        return "", held


class ReasoningParser:
    """A model family's thinking format (subclasses set `in_reasoning_at_start`)."""

    name = ""
    in_reasoning_at_start = False  # the chat template opens <think> in the prompt

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}  # a tag's ids in `tokenizer`

    def streaming(self) -> StreamingReasoningParser:
        return StreamingReasoningParser(self.in_reasoning_at_start)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content): reasoning None when the output did not think,
        content None when nothing follows the thinking."""
        stream = self.streaming()
        parts = [stream.feed(text), stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        return (reasoning if stream.thought else None), (content or None)

    def reasoning_end_token_ids(self, tokenizer: Any = None) -> tuple[int, ...]:
        """The ids of `</think>` in `tokenizer` (default: the one given at construction;
        one id in thinking models, whose tags are added tokens)."""
        return self._tag_ids(END, tokenizer)

    def _tag_ids(self, tag: str, tokenizer: Any = None) -> tuple[int, ...]:
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            raise ValueError("reasoning_end_token_ids needs a tokenizer")
        if tokenizer is None and tag in self._ids:
            return self._ids[tag]
        ids = tuple(tok.encode(tag, add_special_tokens=False))
        if tokenizer is None:
            self._ids[tag] = ids
        return ids

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when the thinking is over at the end of `token_ids`: they hold `</think>`
        after the last `<think>` (a prompt whose template closed an empty block, or an
        output that closed its thinking), so structured outputs apply from the next token.
        A prompt that opens `<think>` after earlier turns' blocks is not over."""
        end = _last(token_ids, self._tag_ids(END))
        return end >= 0 and end > _last(token_ids, self._tag_ids(START))


def _last(ids: Sequence[int], seq: Sequence[int]) -> int:
    """Where the last occurrence of `seq` in `ids` starts; -1 if none."""
    n = len(seq)
    if not n:
        return -1
    ids = list(ids)
    seq = list(seq)
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == seq[0] and ids[i:i + n] == seq:
            return i
    return -1


_REGISTRY: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(*names: str
                              ) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        for n in names:
            _REGISTRY[n] = cls
        cls.name = cls.name or names[0]
        return cls
    return add


def reasoning_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; KeyError names the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; known: "
                       f"{', '.join(reasoning_parser_names())}") from None


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and Qwen3 thinking-2507, QwQ): the template opens `<think>` in the
    prompt, so the output starts inside the thinking (a leading `<think>` is dropped);
    everything up to `</think>` is reasoning, all of it if the output never closes it."""

    in_reasoning_at_start = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output thinks only when it starts with `<think>` (none with
    `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty
    block in the prompt); otherwise it is all content."""

    in_reasoning_at_start = False
