"""Torch-free tokenizer: a typed wrapper around `tokenizers.Tokenizer`.

Loads a byte-level BPE tokenizer straight from GGUF metadata (cached on disk by the file's
SHA-256) or from a Hugging Face tokenizer directory, and exports HF directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from tandem.protocol.chat_template import ChatTemplateError, render_chat
from tandem.protocol.long_text import ChunkedEncoder, chunkable
from tandem.protocol.tokenize_proc import TokenizeError, TokenizeProcess

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump whenever the conversion below changes its output
# `encode_async`: uncached text beyond this is encoded off the loop (~0.15 ms of the bundled
# model's tokenizer; a round trip to a helper process or a thread costs the loop ~0.03 ms)
OFFLOAD_CHARS = 1024
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
PathLike = str | os.PathLike[str]

# Split regexes keyed by `tokenizer.ggml.pre`, as in the HF tokenizer.json of each family;
# each is followed by a regex-free ByteLevel step.
_CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_TAIL = r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+{_TAIL}"
_QWEN2 = rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+{_TAIL}"
_QWEN35 = (rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
           rf"| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+{_TAIL}")
_LO, _UP = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_NLN = r"[^\r\n\p{L}\p{N}]?"
_SLASH_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = rf"{_NLN}{_UP}*{_LO}+{_CONTR}?|{_NLN}{_UP}+{_LO}*{_CONTR}?|\p{{N}}{{1,3}}{_SLASH_TAIL}"
_TEKKEN = rf"{_NLN}{_UP}*{_LO}+|{_NLN}{_UP}+{_LO}*|\p{{N}}{_SLASH_TAIL}"
SPLIT_REGEXES: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "smaug-bpe",
                     "dbrx", "pixtral", "lfm2", "midm-2.0"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), _GPT4O),
    "qwen35": _QWEN35, "tekken": _TEKKEN}
# Families whose tokenizer.json splits off every digit, then applies the GPT-2 regex.
DIGIT_SPLIT = frozenset({"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"})
# Special tokens that end a turn; llama.cpp treats these as end-of-generation as well.
_EOG_TEXTS = frozenset({"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                        "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<|return|>"})
_KEEP = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2 byte -> char map
_BYTE_CHARS = {**{b: chr(b) for b in _KEEP},
               **{b: chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(_KEEP)))}}
_ALPHABET = frozenset(_BYTE_CHARS.values())
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))


def read_gguf_metadata(path: PathLike, prefix: str = "tokenizer.") -> dict[str, Any]:
    """Key/value metadata of a GGUF v2/v3 file; stops before the tensor infos. Arrays are
    lists only under keys starting with `prefix` (others give their length), so only the
    metadata pages of the file are read. Raises ValueError on a non-GGUF or corrupt file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        end = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        version, _, n_kv = struct.unpack_from(end + "IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        pos = 24

        def take(fmt: str) -> tuple[Any, ...]:
            nonlocal pos
            out = struct.unpack_from(end + fmt, buf, pos)
            pos += struct.calcsize(end + fmt)
            return out

        def value(vtype: int, keep: bool) -> Any:
            nonlocal pos
            if vtype == 8:
                (n,) = take("Q")
                pos += n
                return buf[pos - n:pos].decode("utf-8", errors="replace")
            if vtype != 9:
                return take(_SCALARS[vtype])[0]
            etype, count = take("IQ")
            if etype in _SCALARS and not keep:  # skip a numeric array without unpacking it
                pos += struct.calcsize(end + _SCALARS[etype]) * count
                return count
            items = list(take(f"{count}{_SCALARS[etype]}")) if etype in _SCALARS else \
                [value(etype, keep) for _ in range(count)]
            return items if keep else count

        meta: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key = value(8, True)
                meta[key] = value(take("I")[0], key.startswith(prefix))
        except (struct.error, KeyError) as exc:
            raise ValueError(f"{path}: truncated or corrupt GGUF metadata ({exc})") from None
        return meta


def cache_root() -> Path:
    """Where converted tokenizers live: `bundled.cache_dir()` (`$TANDEM_CACHE_DIR` or the user
    cache) + /tokenizers."""
    from tandem.protocol.bundled import cache_dir

    return cache_dir() / "tokenizers"


def file_digest(path: PathLike, root: Path) -> str:
    """SHA-256 of a file, memoized in `root/by-stat` by (path, size, mtime) so restarts with a
    multi-GB model do not re-hash it."""
    st = os.stat(path)
    stat_key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    memo = root / "by-stat" / hashlib.sha256(stat_key).hexdigest()[:32]
    with contextlib.suppress(OSError):
        if len(digest := memo.read_text(encoding="ascii").strip()) == 64:
            return digest
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    with contextlib.suppress(OSError):
        _write_atomic(memo, sha.hexdigest())
    return sha.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + os.replace: readers never see halves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; exported files are read by other engines
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def convert_gguf(meta: Mapping[str, Any]) -> tuple[_Backend, dict[str, Any]]:
    """(backend tokenizer, Tokenizer kwargs) from GGUF `tokenizer.*` metadata ('gpt2' only)."""
    if (kind := meta.get("tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):  # normal tokens not in byte-level spelling: re-spell them
        if types[i] not in (CONTROL, USER_DEFINED) and not set(tok) <= _ALPHABET:
            tok = "".join(_BYTE_CHARS[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=pre not in SPLIT_REGEXES)
    first: pre_tokenizers.PreTokenizer | None = None
    if pre in SPLIT_REGEXES:
        first = pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated")
    elif pre in DIGIT_SPLIT:
        first = pre_tokenizers.Digits(individual_digits=True)
    elif pre not in ("default", "gpt-2", "gpt2"):
        log.warning("unknown tokenizer.ggml.pre %r; using the GPT-2 split", pre)
    backend.pre_tokenizer = pre_tokenizers.Sequence([first, byte_level]) if first else byte_level
    backend.decoder = decoders.ByteLevel()
    for kind, special in ((CONTROL, True), (USER_DEFINED, False)):
        backend.add_tokens([AddedToken(tokens[i], special=special, normalized=False)
                            for i in added if types[i] == kind])

    def tid(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None

    eos = [tid(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id") if tid(k) is not None]
    eos += [i for i in added if types[i] == CONTROL and tokens[i] in _EOG_TEXTS]
    return backend, {
        "bos_token_id": tid("bos_token_id"), "eos_token_id": tid("eos_token_id"),
        "eos_token_ids": list(dict.fromkeys(eos)), "pad_token_id": tid("padding_token_id"),
        "unk_token_id": tid("unknown_token_id"),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template")}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    """Typed wrapper over a fast `tokenizers.Tokenizer` plus the model's special-token facts."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 pad_token_id: int | None = None, unk_token_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 set_post_processor: bool = True) -> None:
        """`set_post_processor=False` keeps the backend's own BOS/EOS post-processor."""
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.unk_token_id = pad_token_id, unk_token_id
        self._eos_ids = tuple(dict.fromkeys(
            [i for i in (eos_token_id, *eos_token_ids) if i is not None]))
        self.add_bos = add_bos and bos_token_id is not None
        self.add_eos = add_eos and eos_token_id is not None
        self._chat_template = chat_template
        # texts go through cached pieces when that provably changes nothing
        # (protocol.long_text); with the backend's own post-processor only without specials
        self._chunked = ChunkedEncoder(backend) if chunkable(backend) else None
        self.source: str | None = None  # the path `load` read (a helper process loads it)
        self.helper: TokenizeProcess | None = None  # `start_helper`
        self._own_specials = set_post_processor
        if set_post_processor:
            bos = [self.token(bos_token_id)] if self.add_bos else []
            eos = [self.token(eos_token_id)] if self.add_eos else []
            backend.post_processor = processors.TemplateProcessing(
                single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
                special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(bos + eos)])

    @classmethod
    def load(cls, path: PathLike) -> Tokenizer:
        """From a `.gguf` file, an HF tokenizer directory, or a directory holding one .gguf."""
        root = Path(path)
        ggufs = [] if (root / "tokenizer.json").is_file() else sorted(root.glob("*.gguf"))
        if root.is_dir() and len(ggufs) == 1:
            tok = cls.from_gguf(ggufs[0])
        else:
            tok = cls.from_dir(root) if root.is_dir() else cls.from_gguf(root)
        tok.source = str(root)
        return tok

    @classmethod
    def from_gguf(cls, path: PathLike, *, use_cache: bool = True) -> Tokenizer:
        """From GGUF metadata; the conversion is cached in `cache_root()/<sha256 of file>/`
        (tokenizer.json + meta.json), so later loads skip reading and converting."""
        root = cache_root()
        entry = root / file_digest(path, root) if use_cache else None
        if entry is not None:
            try:
                info = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
                if info.get("format") == CACHE_FORMAT:
                    backend = _Backend.from_file(str(entry / "tokenizer.json"))
                    return cls(backend, **info["tokenizer"], set_post_processor=False)
            except FileNotFoundError:
                pass
            except Exception as exc:  # corrupt or foreign entry: convert again and overwrite
                log.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
        backend, info = convert_gguf(read_gguf_metadata(path))
        tok = cls(backend, **info)
        if entry is not None:
            try:  # tokenizer.json first: an entry is complete once meta.json exists
                _write_atomic(entry / "tokenizer.json", backend.to_str())
                _write_atomic(entry / "meta.json", json.dumps(
                    {"format": CACHE_FORMAT, "source": str(path), "tokenizer": info}))
            except OSError as exc:
                log.warning("cannot write tokenizer cache %s: %s", entry, exc)
        return tok

    @classmethod
    def from_dir(cls, path: PathLike) -> Tokenizer:
        """From an HF directory: tokenizer.json and tokenizer_config.json, plus optional
        special_tokens_map.json, generation_config.json (eos ids) and the chat template:
        chat_template.jinja (wins, as in transformers), else tokenizer_config.json's, else a
        multimodal checkpoint's processor template (chat_template.json, as vLLM falls back
        to)."""
        root = Path(path)
        backend = _Backend.from_file(str(root / "tokenizer.json"))
        config = {**_read_json(root / "special_tokens_map.json"),
                  **_read_json(root / "tokenizer_config.json")}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"),
                            None)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif not template:
            processor = _read_json(root / "chat_template.json").get("chat_template")
            template = processor if isinstance(processor, str) else None

        def tid(name: str) -> int | None:
            text = config.get(name)
            text = text.get("content") if isinstance(text, dict) else text
            return backend.token_to_id(text) if isinstance(text, str) else None

        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id", [])
        eos = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos])
               if isinstance(i, int)]
        eos += [i for i, t in sorted(backend.get_added_tokens_decoder().items())
                if t.special and t.content in _EOG_TEXTS]
        bos_id = tid("bos_token")
        explicit = "add_bos_token" in config or "add_eos_token" in config
        add_bos = config.get("add_bos_token") if explicit else (
            bos_id is not None and backend.encode("").ids[:1] == [bos_id])
        return cls(backend, bos_token_id=bos_id, eos_token_id=tid("eos_token"),
                   eos_token_ids=eos, pad_token_id=tid("pad_token"), unk_token_id=tid("unk_token"),
                   add_bos=bool(add_bos), add_eos=bool(config.get("add_eos_token")),
                   chat_template=template, set_post_processor=explicit)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids. BOS/EOS are added only when the model asks for them and the flag is set;
        special-token text such as `<|im_start|>` always encodes to its single id. Where that
        is exact (`protocol.long_text`), the text is split at added tokens and long stretches
        at safe spaces, and the pieces come from a cache or are encoded in parallel."""
        if self._chunked is not None and (self._own_specials or not add_special_tokens):
            ids = self._chunked.encode(text)
            if add_special_tokens and self.add_bos:
                ids.insert(0, self.bos_token_id)
            if add_special_tokens and self.add_eos:
                ids.append(self.eos_token_id)
            return ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = True,
                           offload_chars: int = OFFLOAD_CHARS) -> list[int]:
        """`encode`, for an event loop: when more than `offload_chars` characters are not
        cached, the tokenizer's own call runs off the loop (`_offload`: the helper process
        of `start_helper`, else a worker thread) and the loop serves others meanwhile; the
        cache lookups and the rest stay on the loop."""
        chunked = self._chunked
        if chunked is not None and (self._own_specials or not add_special_tokens):
            plan = chunked.plan(text)
            if plan.todo_chars > offload_chars:
                encoded = await self._offload(plan.todo, False)
            else:
                encoded = chunked.encode_batch(plan.todo) if plan.todo else []
            ids = chunked.complete(plan, encoded)
            if add_special_tokens and self.add_bos:
                ids.insert(0, self.bos_token_id)
            if add_special_tokens and self.add_eos:
                ids.append(self.eos_token_id)
            return ids
        if len(text) <= offload_chars:
            return self.encode(text, add_special_tokens)
        return (await self._offload([text], add_special_tokens))[0]

    async def _offload(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """`backend.encode_batch(texts)`'s ids, off the calling loop: in the helper process
        when there is one and it is ready, else on a worker thread."""
        if self.helper is not None:
            try:
                return await self.helper.encode(texts, add_special_tokens)
            except TokenizeError:
                pass  # starting, or gone: a thread this time
        if self._chunked is not None and not add_special_tokens:
            encoded = await asyncio.to_thread(self._chunked.encode_batch, texts)
        else:  # the batch call is the one that drops the GIL
            encoded = await asyncio.to_thread(self.backend.encode_batch, texts,
                                              add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def start_helper(self) -> None:
        """Tokenize long texts for `encode_async` in a helper process
        (`protocol.tokenize_proc`) loaded from the same path, started on the first one:
        no GIL shared with the caller's loop. Only for a tokenizer loaded from a path."""
        if self.source is None:
            raise ValueError("a helper process needs a tokenizer loaded from a path")
        if self.helper is None:
            self.helper = TokenizeProcess(self.source)

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` over many texts (parallel inside `tokenizers`)."""
        out = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in out]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence decodes to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings (byte-level spelling) of `ids`; None for unknown ids."""
        return [self.backend.id_to_token(i) for i in ids]

    def token(self, token_id: int | None) -> str | None:
        """Vocabulary string of one id (None for None or an unknown id)."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS first, then end-of-turn/EOG tokens."""
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Sorted ids of all special tokens (added special tokens plus bos/eos/pad/unk)."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids |= {self.bos_token_id, self.pad_token_id, self.unk_token_id, *self._eos_ids}
        return tuple(sorted(i for i in ids if i is not None))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **extra: Any) -> str | list[int]:
        """Render `messages` with the model's template; with `tokenize`, its ids (no BOS added:
        templates write their own). ChatTemplateError on bad input or a model without one."""
        if not self._chat_template:
            raise ChatTemplateError("this model has no chat template")
        text = render_chat(self._chat_template, messages, add_generation_prompt,
                           bos_token=self.token(self.bos_token_id) or "",
                           eos_token=self.token(self.eos_token_id) or "", **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_hf(self, out_dir: PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json (special tokens, add_bos/add_eos,
        chat_template) and special_tokens_map.json, loadable by transformers/vLLM."""
        out = Path(out_dir)
        names = {f"{k}_token": self.token(getattr(self, f"{k}_token_id"))
                 for k in ("bos", "eos", "pad", "unk")}
        names = {k: v for k, v in names.items() if v is not None}
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos, **names}
        if self._chat_template:
            config["chat_template"] = self._chat_template
        _write_atomic(out / "tokenizer.json", self.backend.to_str(pretty=True))
        for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", names)):
            _write_atomic(out / name, json.dumps(data, indent=2, ensure_ascii=False))
