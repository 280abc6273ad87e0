"""The init containers' work: `python -m tandem.operator.fetch model|tokenizer ...`.

    model --repo ORG/REPO [--revision REV] [--path FILE] --dest DIR [--shared]
    tokenizer (--repo ORG/REPO [--revision REV] [--path P] | --local PATH | --bundled) --dest DIR
    adapters JSON...

`model` downloads a Hugging Face repository (or one file or folder of it) into DIR: of a
repository or folder only the files the engine reads (`protocol.hub.MODEL_PATTERNS`, the
patterns `tandem worker --model ORG/NAME` fetches into the hub cache), of a file that file. With
`--shared`, DIR lies on a ReadWriteMany cache volume that many pods fill at once: the first
to take the advisory lock (`DIR.lock`, `fcntl.lockf`, which NFS carries) downloads into a
private `DIR.partial-*` directory, writes the completion marker last and renames it to DIR
(atomic); the others wait on the lock and find DIR complete, as does every later pod.

`tokenizer` writes only what the router needs to tokenize as the workers do (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, chat_template.jinja)
into DIR: from the repository's files, from a GGUF's metadata (for a `.gguf` on the Hub only
the metadata prefix of the file is fetched, by HTTP range requests), or from a local path.
`adapters` prepares `spec.lora`'s adapters, one compact JSON object each:
`{"repo", "revision", "path", "dest"}` downloads the adapter at PATH of the repository (its
adapter_config.json and adapter_model.safetensors only) into DEST, `{"local": DIR}` names
one already mounted; with `"sha256"` the adapter_model.safetensors must hash to it, else the
container exits non-zero naming the file and both digests (the pod never starts its worker).

`HF_TOKEN` (from a Secret, never an argument) authenticates gated repositories.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from tandem.protocol.file_digest import file_sha256
from tandem.protocol.hub import MODEL_PATTERNS, TOKENIZER_PATTERNS, HubRef, ModelSourceError
from tandem.protocol.hub import download as hub_download

logger = logging.getLogger(__name__)
MARKER = ".tandem-complete"  # written last: a cache directory without it is not used
TOKENIZER_FILES = TOKENIZER_PATTERNS  # the router's (and `tandem router --tokenizer ORG/NAME`)
FIRST_PREFIX = 8 << 20  # bytes of a GGUF first fetched for its metadata; x4 until it parses
MAX_PREFIX = 1 << 30
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what the engine reads


def is_complete(dest: Path) -> bool:
    return (dest / MARKER).is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path`; where the filesystem has no locks, none."""
    with open(path, "a+b") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX)
        except OSError as exc:  # ENOLCK & co: the atomic rename still keeps DIR whole
            logger.warning("no lock on %s (%s); filling without one", path, exc)
        yield


def fill_once(dest: Path, download: Callable[[Path], None]) -> bool:
    """Fill `dest` by `download(tmp_dir)` unless it is complete already; True if this call
    downloaded. Safe against concurrent callers on other pods and against a crash midway
    (a leftover partial directory is never renamed into place)."""
    if is_complete(dest):
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.with_name(dest.name + ".lock")):
        if is_complete(dest):
            return False
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
        try:
            download(tmp)
            (tmp / MARKER).write_text(f"{time.time():.0f}\n")
            if dest.exists():  # an incomplete leftover of a filesystem without rename(2)
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def model_patterns(path: str) -> list[str]:
    """What `model` fetches of PATH in a repository: the engine's files (`MODEL_PATTERNS`)
    of the repository's root, or PATH itself (a file) and the engine's files of PATH (a
    folder)."""
    if not path:
        return list(MODEL_PATTERNS)
    return [path, *(f"{path}/{n}" for n in MODEL_PATTERNS)]


def hf_download(repo: str, revision: str, path: str, dest: Path,
                patterns: list[str] | None = None) -> None:
    """`patterns` of the repository (None: `model_patterns(path)`) into `dest`; SystemExit
    with the hub's error in one line (`protocol.hub.download`)."""
    try:
        hub_download(HubRef(repo, revision or None), patterns or model_patterns(path),
                     local_dir=dest)
    except ModelSourceError as exc:
        raise SystemExit(f"fetch: {exc}") from None


def gguf_tokenizer(read_prefix: Callable[[int], bytes], dest: Path) -> int:
    """The tokenizer of a GGUF whose first n bytes `read_prefix(n)` returns (short at the
    end of the file), written as an HF directory; returns how many bytes it read."""
    from tandem.protocol.tokenizer import Tokenizer

    n = FIRST_PREFIX
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "prefix.gguf"
        while True:
            data = read_prefix(n)
            part.write_bytes(data)
            try:
                tok = Tokenizer.from_gguf(part, use_cache=False)
                break
            except ValueError:
                if len(data) < n or n >= MAX_PREFIX:  # the whole file, or too far: corrupt
                    raise
                n *= 4
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_hf(dest)
    return len(data)


def hf_prefix_reader(repo: str, revision: str, path: str) -> Callable[[int], bytes]:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(repo, path, revision=revision or None)

    def read(n: int) -> bytes:
        r = get_session().get(url, headers={**build_hf_headers(), "Range": f"bytes=0-{n - 1}"},
                              timeout=120)
        r.raise_for_status()
        return r.content[:n]  # a server that ignores Range sends everything (200)
    return read


def local_tokenizer(src: Path, dest: Path) -> None:
    """From a `.gguf` file, or a directory with tokenizer.json or exactly one `.gguf` (as
    `Tokenizer.load` picks)."""
    if src.is_dir() and (src / "tokenizer.json").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, dest / name)
        return
    ggufs = sorted(src.glob("*.gguf")) if src.is_dir() else [src]
    if len(ggufs) != 1 or not ggufs[0].is_file():
        raise SystemExit(f"{src}: no tokenizer.json and not exactly one .gguf file")
    with open(ggufs[0], "rb") as f:
        gguf_tokenizer(lambda n: (f.seek(0), f.read(n))[1], dest)


def hf_tokenizer(repo: str, revision: str, path: str, dest: Path) -> None:
    if path.endswith(".gguf"):
        read = gguf_tokenizer(hf_prefix_reader(repo, revision, path), dest)
        logger.info("tokenizer of %s/%s from its first %d bytes", repo, path, read)
        return
    p = PurePosixPath(path or ".")
    folder = str(p.parent if p.suffix else p)  # a file (model.safetensors): its folder
    folder = "" if folder == "." else folder
    with tempfile.TemporaryDirectory() as tmp:
        hf_download(repo, revision, "", Path(tmp),
                    [f"{folder}/{n}" if folder else n for n in TOKENIZER_FILES])
        local_tokenizer(Path(tmp, folder), dest)


def prepare_adapter(item: dict[str, str]) -> Path:
    """Download (`repo` ...) or find (`local`) one adapter, check its files and `sha256`;
    returns its directory. SystemExit names what is wrong."""
    if "local" in item:
        where = adapter = Path(item["local"])
    else:
        folder = item.get("path", "")
        hf_download(item["repo"], item.get("revision", ""), "", Path(item["dest"]),
                    [f"{folder}/{n}" if folder else n for n in ADAPTER_FILES])
        adapter = Path(item["dest"], folder)
        where = f"hf://{item['repo']}" + (f"@{item['revision']}" if item.get("revision")
                                          else "") + (f"/{folder}" if folder else "")
    missing = [n for n in ADAPTER_FILES if not (adapter / n).is_file()]
    if missing:
        raise SystemExit(f"adapter {where}: no {' or '.join(missing)} (a PEFT adapter "
                         "directory has both)")
    want = item.get("sha256")
    if want:
        weights = adapter / ADAPTER_FILES[1]
        got = file_sha256(weights)
        if got != want.lower():
            raise SystemExit(f"{weights}: sha256 {got}, lora.adapters pins {want}")
        logger.info("%s: sha256 %s as pinned", weights, got)
    return adapter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.operator.fetch")
    p.add_argument("what", choices=("model", "tokenizer", "adapters"))
    p.add_argument("adapters", nargs="*", default=[], metavar="JSON")
    p.add_argument("--repo", default="")
    p.add_argument("--revision", default="")
    p.add_argument("--path", default="")
    p.add_argument("--local", default=None)
    p.add_argument("--bundled", action="store_true")
    p.add_argument("--dest", default=None)
    p.add_argument("--shared", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.what == "adapters":
        for text in args.adapters:
            logger.info("adapter ready in %s", prepare_adapter(json.loads(text)))
        return 0
    if not args.dest or args.adapters:
        raise SystemExit(f"{args.what}: --dest DIR is required, and no JSON arguments")
    dest = Path(args.dest)
    if args.what == "model":
        if not args.repo:
            raise SystemExit("model: --repo is required")
        if not args.shared:
            hf_download(args.repo, args.revision, args.path, dest)
        elif not fill_once(dest, lambda tmp: hf_download(args.repo, args.revision,
                                                         args.path, tmp)):
            logger.info("%s: complete in the shared cache, nothing to download", dest)
    elif args.bundled:
        from tandem.protocol.bundled import find_bundled_gguf

        gguf = find_bundled_gguf()
        if gguf is None:
            raise SystemExit("the bundled model is not installed in this image")
        local_tokenizer(gguf, dest)
    elif args.local:
        local_tokenizer(Path(args.local), dest)
    elif args.repo:
        hf_tokenizer(args.repo, args.revision, args.path, dest)
    else:
        raise SystemExit("tokenizer: --repo, --local or --bundled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
