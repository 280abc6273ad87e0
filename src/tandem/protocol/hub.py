"""Where a named model's files are: a local path, or a Hugging Face repository in the hub cache.

Torch-free: the engine, `tandem worker` / `serve` / `generate`, the router's tokenizers and
the operator's init container all resolve names here, with the same file patterns.

- `resolve_model(name, revision)`: an existing path, or one spelled as a path (`/...`,
  `./...`, `~/...`, `*.gguf` that is not `ORG/NAME/FILE.gguf`), is used as it is. Otherwise
  `ORG/NAME` (or `NAME`) is a repository id, downloaded into the standard hub cache by
  `huggingface_hub` (`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`, progress bars):
  only what the engine reads (`MODEL_PATTERNS`: config, generation config, tokenizer, chat
  template, safetensors and their index). `ORG/NAME/FILE.gguf` names one GGUF file of a
  repository (only that file is fetched). `ORG/NAME@REV` is the same as `revision=REV`.
  With `HF_HUB_OFFLINE=1` the cache alone answers and nothing touches the network.
- `generation_defaults(model_dir, source)`: the sampling defaults of vLLM's
  `--generation-config` (`auto`: the model's generation_config.json; `vllm`: none; or a
  directory holding a generation_config.json).

Every failure is a `ModelSourceError` (a ValueError) whose one-line message names the
repository and what to do: not cached while offline (the cache directory, HF_HUB_OFFLINE),
gated or private (HF_TOKEN), no such repository, revision or file, a malformed id.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json", "chat_template.jinja", "chat_template.json")
# what the engine reads of a Hugging Face model repository (weights, configs, tokenizer);
# quantize_config.json / quant_config.json: older GPTQ / AWQ checkpoints' quantization config
MODEL_PATTERNS = ("config.json", *TOKENIZER_PATTERNS, "*.safetensors",
                  "*.safetensors.index.json", "quantize_config.json", "quant_config.json")
GENERATION_SOURCES = ("auto", "vllm")  # or a directory
# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param)
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^(?P<repo>(?:{_PART}/)?{_PART})(?:@(?P<rev>[\w.-]+))?"
                      rf"(?:/(?P<file>(?:[\w.-]+/)*[\w.-]+\.gguf))?$")
_TRUE = ("1", "on", "yes", "true")


class ModelSourceError(ValueError):
    """A model or tokenizer name that cannot be resolved to local files (one-line message)."""


@dataclass(frozen=True)
class HubRef:
    """A Hugging Face repository (`repo`), at `revision` (None: main), optionally one `file`
    of it (a .gguf)."""

    repo: str
    revision: str | None = None
    file: str = ""

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{rev}" + (f"/{self.file}" if self.file else "")


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now: `HF_HUB_CACHE`, else
    `HF_HOME/hub`, else `~/.cache/huggingface/hub`."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (read now, not when huggingface_hub was imported) is set."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def looks_local(name: str) -> bool:
    """`name` exists here, or is spelled as a path rather than a repository id."""
    if os.path.exists(os.path.expanduser(name)):
        return True
    if name.startswith(("/", ".", "~")) or "\\" in name:
        return True
    return name.lower().endswith(".gguf") and name.count("/") < 2


def parse_hub_ref(name: str, revision: str | None = None) -> HubRef:
    """`ORG/NAME[@REV][/FILE.gguf]` (or `NAME`) as a HubRef; `revision` applies unless the
    name carries its own. ModelSourceError for anything else."""
    m = _REPO_ID.match(name)
    if m is None or ".." in name or "--" in m["repo"]:
        raise ModelSourceError(
            f"{name!r} is neither a local path nor a Hugging Face repository id "
            "(ORG/NAME, ORG/NAME@REVISION or ORG/NAME/FILE.gguf)")
    if m["rev"] and revision and m["rev"] != revision:
        raise ModelSourceError(f"{name!r} names revision {m['rev']!r}, --revision {revision!r}")
    return HubRef(m["repo"], m["rev"] or revision or None, m["file"] or "")


def resolve_model(name: str, revision: str | None = None, *,
                  tokenizer_only: bool = False) -> Path:
    """The local path of `name` (see the module doc): a path as it is, a repository's
    snapshot directory in the hub cache (a GGUF file in it for `ORG/NAME/FILE.gguf`).
    `tokenizer_only`: fetch only `TOKENIZER_PATTERNS` (the router's needs)."""
    if looks_local(name):
        return Path(name).expanduser()
    ref = parse_hub_ref(name, revision)
    if ref.file:
        patterns: tuple[str, ...] = (ref.file,)
    else:
        patterns = TOKENIZER_PATTERNS if tokenizer_only else MODEL_PATTERNS
    root = download(ref, patterns)
    if ref.file:
        if not (root / ref.file).is_file():
            raise ModelSourceError(f"{ref.repo} has no file {ref.file}")
        return root / ref.file
    need = "tokenizer.json" if tokenizer_only else "config.json"
    if not (root / need).is_file():
        ggufs = sorted(p.name for p in root.glob("*.gguf"))
        hint = (f"; a GGUF repository? name the file: {ref.repo}/<FILE>.gguf"
                if not tokenizer_only else "")
        raise ModelSourceError(f"{ref} has no {need}{hint}" + (
            f" (e.g. {ref.repo}/{ggufs[0]})" if ggufs else ""))
    return root


def download(ref: HubRef, patterns: tuple[str, ...] | list[str] | None,
             local_dir: Path | None = None) -> Path:
    """`snapshot_download` of `ref` limited to `patterns` (None: every file) into the hub
    cache (or into `local_dir`); returns the snapshot directory. Offline (`HF_HUB_OFFLINE`)
    only the cache is read. Every hub error becomes a one-line ModelSourceError."""
    from huggingface_hub import constants, errors, snapshot_download

    offline = hub_offline() or bool(constants.HF_HUB_OFFLINE)  # now, or at its import
    cache = hub_cache_dir()
    rev = ref.revision or "main"
    try:
        path = snapshot_download(
            ref.repo, revision=ref.revision, allow_patterns=list(patterns) if patterns else None,
            cache_dir=None if local_dir is not None else str(cache),
            local_dir=str(local_dir) if local_dir is not None else None,
            local_files_only=offline)
    except errors.HFValidationError as exc:
        raise ModelSourceError(f"{ref.repo!r} is not a valid Hugging Face repository id "
                               f"({_first_line(exc)})") from None
    except errors.GatedRepoError:
        raise ModelSourceError(
            f"{ref.repo} is a gated repository: accept its terms on huggingface.co and set "
            "HF_TOKEN to a token of that account") from None
    except errors.RevisionNotFoundError:
        raise ModelSourceError(f"{ref.repo} has no revision {rev!r}") from None
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(
            f"no Hugging Face repository {ref.repo} (or it is private: set HF_TOKEN), and no "
            f"local path {str(ref)!r}") from None
    except errors.RemoteEntryNotFoundError:
        raise ModelSourceError(f"{ref.repo} has no file {ref.file or patterns}") from None
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError) as exc:
        if offline:
            raise ModelSourceError(
                f"{ref.repo} (revision {rev}) is not in the Hugging Face cache {cache} and "
                "HF_HUB_OFFLINE=1 forbids downloading it: download it once online, or point "
                "HF_HUB_CACHE / HF_HOME at a cache that holds it") from None
        raise ModelSourceError(
            f"cannot download {ref.repo} (revision {rev}) from {constants.ENDPOINT} and the cache "
            f"{cache} does not hold it: {_first_line(exc)}") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise ModelSourceError(f"{ref.repo}: access refused (HTTP {status}); set HF_TOKEN "
                                   "to a token that may read it") from None
        raise ModelSourceError(f"{ref.repo}: {_first_line(exc)}") from None
    logger.info("%s: %s", ref, path)
    return Path(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def generation_defaults(model: str | os.PathLike[str] | None,
                        source: str = "auto") -> dict[str, Any]:
    """SamplingParams defaults from a generation_config.json (vLLM's `--generation-config`):
    `auto` the model directory's (none for a GGUF file or the bundled model), `vllm` none, a
    directory its own (ModelSourceError if it has none). Keys `GENERATION_KEYS` maps;
    `max_new_tokens` becomes `max_tokens`. Values of the wrong type are skipped (logged)."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model is None or not Path(model).is_dir():
            return {}
        path = Path(model) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(source).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ModelSourceError(f"--generation-config {source}: no generation_config.json "
                                   "there (or 'auto' / 'vllm')")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{path}: not readable JSON ({exc})") from None
    out: dict[str, Any] = {}
    for key, field in GENERATION_KEYS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if value is None:
            continue
        integral = field in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                integral and not float(value).is_integer()):
            logger.warning("%s: ignoring %s=%r (not a number)", path, key, value)
            continue
        out[field] = int(value) if integral else float(value)
    if out:
        logger.info("sampling defaults from %s: %s", path, out)
    return out
