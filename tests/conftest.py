"""Shared fixtures: the real bundled model is loaded once per session (tests marked `slow`)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bundled_gguf():
    from tandem.engine.model.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_reference(bundled_gguf):
    """transformers' own load of the same GGUF (it dequantizes and un-permutes itself)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": bundled_gguf.name}
    model = AutoModelForCausalLM.from_pretrained(str(bundled_gguf.parent), dtype=torch.float32,
                                                 **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(str(bundled_gguf.parent), **kwargs)
    return model, tok


@pytest.fixture(scope="session")
def real_llm():
    from tandem import LLM

    return LLM(dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=512)
