"""Tandem: Kubernetes-native LLM serving.

`from tandem import LLM, SamplingParams` is the offline API (`StructuredOutputs` for
`SamplingParams.structured_outputs`, vLLM's `StructuredOutputsParams`). The names are
resolved lazily so that torch-free components (router, operator) can import
`tandem.protocol` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "LoRARequest", "RequestOutput",
           "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.lora.request import LoRARequest
    from tandem.engine.outputs import CompletionOutput, RequestOutput
    from tandem.engine.sampling_params import SamplingParams
    from tandem.protocol.structured_outputs import StructuredOutputs

_LAZY = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.engine.sampling_params",
    "StructuredOutputs": "tandem.protocol.structured_outputs",
    "LoRARequest": "tandem.engine.lora.request",
    "RequestOutput": "tandem.engine.outputs",
    "CompletionOutput": "tandem.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
