"""Reasoning parsers, by vLLM's names (`--reasoning-parser`): `deepseek_r1`, `qwen3`."""

from tandem.serving.reasoning.base import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    StreamingReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "StreamingReasoningParser", "get_reasoning_parser", "reasoning_parser_names",
           "register_reasoning_parser"]
