"""Tool-call parsers, by vLLM's names (`--tool-call-parser`): `hermes` (also Qwen2.5 and
Qwen3), `llama3_json` (`llama4_json`), `mistral`, `qwen3_coder` (`qwen3_xml`)."""

from tandem.serving.tool_parsers import hermes, llama3_json, mistral, qwen3_coder  # noqa: F401
from tandem.serving.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    random_tool_call_id,
    register_tool_parser,
    tool_parser_names,
)

__all__ = ["ExtractedToolCalls", "StreamDelta",
           "StreamingToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "get_tool_parser",
           "random_tool_call_id", "register_tool_parser", "tool_parser_names"]
