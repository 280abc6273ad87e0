"""`tandem worker --model-sha256`: what is hashed (a file; an HF directory's sorted
`sha256sum *.safetensors` listing), and a worker process that refuses a model whose digest
differs, naming both digests, before it loads anything."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from tandem.protocol.bundled import find_bundled_gguf
from tandem.serving.digest import DigestMismatchError, model_sha256, verify_model

from .helpers import free_port, start_worker


def test_a_file_hashes_like_sha256sum(tmp_path):
    f = tmp_path / "m.gguf"
    data = b"GGUF" + bytes(range(256)) * 40_000  # 10 MB: two 8 MiB reads
    f.write_bytes(data)
    assert model_sha256(f) == hashlib.sha256(data).hexdigest()
    assert verify_model(f, hashlib.sha256(data).hexdigest().upper()) == model_sha256(f)


def test_an_hf_directory_hashes_its_sorted_weight_listing(tmp_path):
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"second")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")  # not a weight: not pinned
    listing = "".join(f"{hashlib.sha256(b).hexdigest()}  model-0000{i}-of-00002.safetensors\n"
                      for i, b in ((1, b"first"), (2, b"second")))
    expected = hashlib.sha256(listing.encode()).hexdigest()
    assert model_sha256(tmp_path) == expected
    (tmp_path / "config.json").write_text('{"changed": true}')
    assert model_sha256(tmp_path) == expected
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"tampered")
    assert model_sha256(tmp_path) != expected


def test_mismatch_and_missing(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    with pytest.raises(DigestMismatchError, match=hashlib.sha256(b"abc").hexdigest()):
        verify_model(f, "0" * 64)
    with pytest.raises(FileNotFoundError):
        model_sha256(tmp_path / "nope.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        model_sha256(tmp_path / "empty")


def test_worker_with_a_wrong_digest_exits_nonzero_naming_both(tmp_path):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"not really a model")  # never loaded: the digest check comes first
    actual = hashlib.sha256(model.read_bytes()).hexdigest()
    wrong = "ab" * 32
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "worker", "--model", str(model),
         "--model-sha256", wrong, "--port", str(free_port())],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"expected sha256 {wrong}" in proc.stderr
    assert f"found {actual}" in proc.stderr


@pytest.mark.slow
def test_worker_with_the_right_digest_serves(tmp_path):
    gguf = find_bundled_gguf()
    assert gguf is not None
    digest = model_sha256(gguf)
    w = start_worker(tmp_path, "--model-sha256", digest)  # waits for /ready
    try:
        assert f"model digest verified: sha256 {digest}" in w.log()
    finally:
        assert w.stop() == 0, w.log()
