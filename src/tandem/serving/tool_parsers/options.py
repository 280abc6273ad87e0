"""The worker's chat-output parsing flags (vLLM's): `--tool-call-parser NAME`,
`--enable-auto-tool-choice` and `--reasoning-parser NAME`, and what they configure."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tandem.engine.errors import ConfigError
from tandem.protocol import engine_flags as flags


@dataclass(frozen=True)
class ChatParsing:
    """How chat outputs are parsed: `tool_call_parser` names the model's tool-call format
    (`tool_choice: "auto"` needs it and `enable_auto_tool_choice`, else it is a 400, as in
    vLLM); `reasoning_parser` splits the thinking into `reasoning_content`."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


def add_chat_parsing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(flags.TOOL_CALL_PARSER, default=None, choices=flags.TOOL_CALL_PARSERS,
                   help="the model's tool-call format, parsed into tool_calls for "
                        "tool_choice \"auto\" (vLLM's names: hermes for Qwen2.5/Qwen3 and "
                        "Hermes, llama3_json, mistral, qwen3_coder; needs "
                        f"{flags.ENABLE_AUTO_TOOL_CHOICE})")
    p.add_argument(flags.ENABLE_AUTO_TOOL_CHOICE, action="store_true",
                   help="let the model choose to call tools (tool_choice \"auto\", the "
                        f"default with tools); needs {flags.TOOL_CALL_PARSER}")
    p.add_argument(flags.REASONING_PARSER, default=None, choices=flags.REASONING_PARSERS,
                   help="return the model's thinking (<think>...</think>) as "
                        "reasoning_content apart from content (deepseek_r1: the template "
                        "opens the thinking; qwen3: the output does)")


def chat_parsing(args: argparse.Namespace) -> ChatParsing:
    """The flags' settings; ConfigError (a usage error) for auto tool choice without a
    parser, as vLLM refuses it."""
    parser = getattr(args, "tool_call_parser", None)
    auto = bool(getattr(args, "enable_auto_tool_choice", False))
    if auto and parser is None:
        raise ConfigError(f"{flags.ENABLE_AUTO_TOOL_CHOICE} needs {flags.TOOL_CALL_PARSER}")
    return ChatParsing(parser, auto, getattr(args, "reasoning_parser", None))
