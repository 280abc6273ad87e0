"""The worker's LoRA surface: the `model` field to an adapter, `/v1/models` cards, and vLLM's
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`.

- A request's `model` is the served base model's name or a loaded adapter's (`resolve`);
  anything else is 404 with an OpenAI error body, before the prompt is tokenized.
- Loading by path is confined to `--lora-dir` roots (`engine/lora/paths.py`): a worker
  without one refuses (400), as it does traversal, symlinks out, URLs and bad files; the
  files are read in a thread, off the event loop and the engine thread, and only the
  validated adapter is handed to the engine. Loading the same name and files again is a
  no-op (200); the name taken by other files is 409.
- Unloading under traffic: the name stops resolving at once; the adapter's queued and
  running requests finish with it and its memory is freed after the last (`"unloading"`),
  at once when it has none (`"unloaded"`).
- Every load and unload answer carries the worker's adapter set after it (`lora`: instance,
  version, name -> weight digest, as `/ready` reports it), so the router applies it at once
  and no older report (a probe answered before the load) can undo it.
- Admin-only when auth is on: a worker with `--worker-auth-key-file` takes load and unload
  calls only under the router's signature over the body for `admin:<path>` (403 otherwise);
  the router takes them only from admin keys.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.errors import ConfigError, UnknownAdapterError
from tandem.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from tandem.engine.lora.manager import LoRAManager
from tandem.protocol.openai_api import (
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
)
from tandem.protocol.signing import WorkerKey, admin_target
from tandem.serving.errors import APIError
from tandem.serving.worker_auth import require_signature

logger = logging.getLogger(__name__)
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name[:256]}` does not exist.", "model")


def resolve(name: str | None, served: str, engine: AsyncLLMEngine,
            aliases: tuple[str, ...] = ()) -> str | None:
    """The adapter a request's `model` names (None: the base model, by its served name or
    one of its `aliases`); 404 otherwise. The engine checks again when it takes the request
    (an unload may come between)."""
    if name is None or name == served or name in aliases:
        return None
    lora = engine.lora
    if lora is None or not lora.has(name):
        raise not_found(name)
    return name


def model_cards(served: str, engine: AsyncLLMEngine, created: int,
                aliases: tuple[str, ...] = ()) -> list[ModelCard]:
    """The base model's card under each served name (as vLLM), then one per loaded adapter
    (`parent`: the base)."""
    state = engine.state
    cards = [ModelCard(id=name, created=created, max_model_len=state.max_model_len,
                       root=state.model_path) for name in (served, *aliases)]
    lora = engine.lora
    if lora is not None:
        registered = dict(lora.registered)  # a copy: the engine thread may add meanwhile
        cards += [ModelCard(id=name, created=created, max_model_len=state.max_model_len,
                            root=registered[name].lora_path, parent=served)
                  for name in lora.names() if name in registered]
    return cards


def install_lora_routes(app: FastAPI, served: str, get_engine: Callable[[], AsyncLLMEngine],
                        auth_key: WorkerKey | None,
                        on_reject: Callable[[str], None] | None = None,
                        aliases: tuple[str, ...] = ()) -> None:
    async def admin(request: Request) -> None:
        if auth_key is not None:
            await require_signature(request, auth_key, admin_target(request.url.path),
                                    "an adapter load or unload", on_reject)

    @app.post(LOAD_PATH)
    async def load(req: LoadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
        await admin(request)
        engine = get_engine()
        manager = engine.lora
        if manager is None:
            raise APIError(400, "this worker was started without --enable-lora", "lora_name")
        if not manager.config.lora_dirs:
            raise APIError(400, "this worker has no --lora-dir, so it loads no adapter by "
                                "path", "lora_path")
        if req.lora_name == served or req.lora_name in aliases:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", "lora_name")
        try:
            wanted = LoRARequest(req.lora_name, 1, req.lora_path,
                                 req.sha256.lower() if req.sha256 else None)
            adapter = await asyncio.to_thread(manager.read, wanted)
        except ConfigError as exc:
            raise APIError(400, str(exc), "lora_path") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_name") from exc
        old = manager.registered.get(req.lora_name)
        if (old is not None and manager.has(req.lora_name) and old.lora_path == adapter.path
                and manager.digests.get(req.lora_name) == adapter.digest):
            return _card(old, "already_loaded", manager)
        try:
            loaded = await engine.load_lora(wanted, adapter=adapter, fresh_id=True)
        except ValueError as exc:  # the name is taken, or being unloaded
            raise APIError(409, str(exc), "lora_name", type_="conflict_error") from exc
        logger.info("loaded LoRA adapter %s (sha256 %s, digest %s)", loaded.lora_name,
                    loaded.sha256, adapter.digest)
        return _card(loaded, "loaded", manager)

    @app.post(UNLOAD_PATH)
    async def unload(req: UnloadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
        await admin(request)
        engine = get_engine()
        try:
            freed = await engine.unload_lora(req.lora_name)
        except UnknownAdapterError as exc:
            raise not_found(req.lora_name) from exc
        logger.info("unloading LoRA adapter %s (%s)", req.lora_name,
                    "freed" if freed else "its requests finish first")
        manager = engine.lora
        return {"object": "lora_adapter", "lora_name": req.lora_name,
                "status": "unloaded" if freed else "unloading",
                **({} if manager is None else {"lora": manager.state.to_json()})}


def _card(lora: LoRARequest, status: str, manager: LoRAManager) -> dict[str, Any]:
    """A load's answer: the adapter (its file's sha256 and weight digest) and the worker's
    adapter set after it."""
    return {"object": "lora_adapter", "lora_name": lora.lora_name,
            "lora_int_id": lora.lora_int_id, "sha256": lora.sha256,
            "digest": manager.digests.get(lora.lora_name, ""), "status": status,
            "lora": manager.state.to_json()}
