"""Engine-test fixtures shared across modules."""

from __future__ import annotations

import pytest

from tests.engine.utils import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random tiny Llama with a trained tokenizer (seed 3), built once per session.
    A module may define its own `tiny_model` for another shape."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model_dir(path, "llama", seed=3, tokenizer="trained")
    return str(path)
