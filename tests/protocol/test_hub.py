"""Model names through the Hugging Face hub cache (`protocol/hub.py`): a populated cache
serves `ORG/NAME` offline with no network call, `--revision` picks a snapshot, only the
engine's files are requested, and every failure is one line naming what to do."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from tandem.protocol import hub
from tandem.protocol.hub import ModelSourceError, generation_defaults, resolve_model
from tests.hub_cache import add_snapshot, no_network

CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache named by HF_HOME (as users set it), offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_a_populated_cache_serves_org_name_offline_without_a_network_call(cache):
    main = add_snapshot(cache, "org/tiny", {"config.json": CONFIG, "model.safetensors": b"w1"})
    tagged = add_snapshot(cache, "org/tiny", {"config.json": CONFIG, "model.safetensors": b"w2"},
                          refs=("v2",))
    with no_network() as tries:
        assert resolve_model("org/tiny") == main
        assert resolve_model("org/tiny", revision="v2") == tagged  # --revision picks one
        assert resolve_model("org/tiny@v2") == tagged
        assert resolve_model("org/tiny", revision=tagged.name) == tagged  # a commit
        assert (resolve_model("org/tiny") / "model.safetensors").read_bytes() == b"w1"
    assert tries == []


def test_a_gguf_file_of_a_repository_and_local_paths(cache, tmp_path):
    snap = add_snapshot(cache, "org/tiny-GGUF", {"tiny.Q4_0.gguf": b"GGUF"})
    assert resolve_model("org/tiny-GGUF/tiny.Q4_0.gguf") == snap / "tiny.Q4_0.gguf"
    with pytest.raises(ModelSourceError, match=r"org/tiny-GGUF@main has no config.json; a "
                       r"GGUF repository\? name the file: org/tiny-GGUF/<FILE>.gguf "
                       r"\(e.g. org/tiny-GGUF/tiny.Q4_0.gguf\)"):
        resolve_model("org/tiny-GGUF", revision="main")
    local = tmp_path / "org" / "tiny"  # a local directory wins over a repository id
    local.mkdir(parents=True)
    for name in (str(local), "./models/x", "~/m.gguf", "m.gguf", "org/x.gguf"):
        assert resolve_model(name) == Path(name).expanduser()


def test_a_missing_model_offline_names_the_repo_the_cache_and_hf_hub_offline(cache):
    with no_network(), pytest.raises(ModelSourceError) as err:
        resolve_model("org/absent")
    assert str(err.value) == (
        f"org/absent (revision main) is not in the Hugging Face cache {cache} and "
        "HF_HUB_OFFLINE=1 forbids downloading it: download it once online, or point "
        "HF_HUB_CACHE / HF_HOME at a cache that holds it")
    add_snapshot(cache, "org/tiny", {"config.json": CONFIG})
    with no_network(), pytest.raises(ModelSourceError, match="org/tiny .revision v9. is not"):
        resolve_model("org/tiny", revision="v9")


@pytest.mark.parametrize("name", ["a/b/c", "org/na me", "-org/x", "org/x/../y.gguf", "o--x/y"])
def test_a_malformed_id_is_a_clear_error(cache, name):
    with pytest.raises(ModelSourceError, match="is neither a local path nor a Hugging Face "
                                               "repository id"):
        resolve_model(name)


class _Hub:
    """The Hub's API over real HTTP, answering every request with `status` and the
    `X-Error-Code` the Hub sends for it."""

    def __init__(self, status: int, code: str) -> None:
        self.paths: list[str] = []
        hub_ = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hub_.paths.append(self.path)
                body = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("status", "code", "message"), [
    (403, "GatedRepo", "org/llama is a gated repository: accept its terms on huggingface.co "
                       "and set HF_TOKEN to a token of that account"),
    (404, "RepoNotFound", "no Hugging Face repository org/llama (or it is private: set "
                          "HF_TOKEN), and no local path 'org/llama'"),
    (404, "RevisionNotFound", "org/llama has no revision 'main'"),
])
def test_hub_refusals_are_one_line_errors_naming_hf_token(cache, monkeypatch, status, code,
                                                          message):
    import huggingface_hub.constants

    server = _Hub(status, code)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at import
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
    try:
        with pytest.raises(ModelSourceError) as err:
            resolve_model("org/llama")
    finally:
        server.server.shutdown()
        server.server.server_close()
    assert str(err.value) == message
    assert "/api/models/org/llama/revision/main" in server.paths


def test_only_the_files_the_engine_reads_are_requested(cache, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((repo, kw["revision"], kw["allow_patterns"], kw["local_files_only"]))
        files = {p: b"x" for p in kw["allow_patterns"] if "*" not in p}  # what matched
        return str(add_snapshot(cache, repo, files))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert (resolve_model("org/tiny", revision="r1") / "config.json").is_file()
    assert (resolve_model("org/tiny", tokenizer_only=True) / "tokenizer.json").is_file()
    assert resolve_model("org/q/sub/f.gguf").read_bytes() == b"x"
    assert calls[0] == ("org/tiny", "r1", list(hub.MODEL_PATTERNS), False)
    assert calls[1] == ("org/tiny", None, list(hub.TOKENIZER_PATTERNS), False)
    assert calls[2] == ("org/q", None, ["sub/f.gguf"], False)  # that file alone
    assert set(hub.MODEL_PATTERNS) >= {"config.json", "generation_config.json",
                                       "tokenizer.json", "tokenizer_config.json",
                                       "chat_template.jinja", "*.safetensors",
                                       "*.safetensors.index.json"}
    assert not any(p.endswith((".bin", ".pt", ".pth", ".gguf", ".onnx", "*"))
                   for p in hub.MODEL_PATTERNS)


def test_generation_defaults_auto_vllm_or_a_directory(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 256, "do_sample": True,
        "eos_token_id": [1, 2]}))
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 256}
    assert generation_defaults(model) == want
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(None) == generation_defaults(tmp_path / "x.gguf") == {}
    other = tmp_path / "g"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2, "top_k": "x"}')
    assert generation_defaults(model, str(other)) == {"temperature": 0.2}  # top_k skipped
    with pytest.raises(ModelSourceError, match=r"--generation-config .*: no "
                                               r"generation_config.json there"):
        generation_defaults(model, str(tmp_path))


def test_the_router_loads_the_workers_tokenizer_from_the_same_repo_offline(cache, tmp_path):
    from tandem.protocol.tokenizer import Tokenizer
    from tandem.router.main import TokenizerResolver
    from tests.engine.utils import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path / "tok")
    files = {p.name: p for p in (tmp_path / "tok").iterdir()}
    add_snapshot(cache, "org/tiny", {"config.json": CONFIG, **files}, refs=("v1",))
    with no_network() as tries:
        resolver = TokenizerResolver(["served=org/tiny@v1"], {})
        resolver.preload()
        tok = resolver("served")
    assert tries == []
    want = Tokenizer.load(tmp_path / "tok")
    text = "<|im_start|>user\nThe capital of France<|im_end|>"
    assert tok.encode(text) == want.encode(text) and tok.chat_template == want.chat_template
