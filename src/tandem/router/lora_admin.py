"""The router's `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`: one call
loads (or unloads) an adapter on every ready LoRA-enabled worker.

- Admin-only when auth is on: with `--api-keys`, the caller's key must be in
  `--admin-api-keys` (same file format): 401 without a valid key, 403 for a tenant key.
  Without `--api-keys` (auth off) anyone who reaches the router may call them, as with a
  vLLM server without `--api-key`.
- Each worker call is signed with the worker auth key for `admin:<path>` (the worker takes
  no other when it has a key) and answered by the worker itself: paths are confined by
  each worker's `--lora-dir`.
- The answer: 200 when every worker succeeded; when all failed with one status, that
  status and the first worker's error body; else 502. Either way `workers` lists each
  worker's status. Routing learns the change at once: each worker's answer carries its
  versioned adapter set (`LoRAReport`), which no older probe or load report can undo.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tandem.protocol.openai_api import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, admin_target
from tandem.protocol.web import APIError, bad_body, require_json
from tandem.router.auth import ApiKeys
from tandem.router.core import Router
from tandem.router.workers import LoRAReport, Worker

logger = logging.getLogger(__name__)
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
TIMEOUT_S = 60.0  # one worker's load: reading and validating the adapter's files


def check_admin(api_keys: ApiKeys, admin_keys: ApiKeys | None, authorization: str | None
                ) -> None:
    """Raise 401 / 403 unless auth is off or `authorization` holds an admin key."""
    if not api_keys.enabled:
        return
    if admin_keys is not None and admin_keys.enabled:
        try:
            admin_keys.tenant(authorization)
            return
        except APIError:
            pass
    api_keys.tenant(authorization)  # 401 when it is no key at all
    raise APIError(403, "this API key may not load or unload adapters (admin keys: "
                        "--admin-api-keys)", type_="permission_error")


def install_lora_admin(app: FastAPI, router: Router, api_keys: ApiKeys,
                       admin_keys: ApiKeys | None, worker_key: WorkerKey | None,
                       http: Callable[[], httpx.AsyncClient]) -> None:
    async def fan_out(path: str, request: Request, model: type) -> JSONResponse:
        check_admin(api_keys, admin_keys, request.headers.get("authorization"))
        require_json(request)
        body = await request.body()
        try:
            req = model.model_validate(json.loads(body))
        except (ValueError, ValidationError) as exc:  # not JSON, or not the schema
            raise bad_body(exc) from exc
        ready = [w for w in router.workers.values() if w.ready]
        targets = [w for w in ready if w.lora_slots > 0]
        if not ready:
            raise APIError(503, "no worker is ready; retry later", headers={"Retry-After": "5"})
        if not targets:
            raise APIError(400, "no worker here serves LoRA adapters (workers need "
                                "--enable-lora)", "lora_name")
        headers = {"content-type": "application/json"}
        if worker_key is not None:
            headers[SIGNATURE_HEADER] = worker_key.sign(body, admin_target(path))
        results = await asyncio.gather(*[_call(http(), w, path, body, headers)
                                         for w in targets])
        ok = [w for w, (status, _) in zip(targets, results, strict=True) if status < 300]
        for w, (status, result) in zip(targets, results, strict=True):
            if status < 300:
                _apply(w, path, req.lora_name, result)
        per_worker = [{"worker": w.id, "status": s, "result": r}
                      for w, (s, r) in zip(targets, results, strict=True)]
        logger.info("%s %s: %d of %d workers ok", path, req.lora_name, len(ok), len(targets))
        statuses = {s for s, _ in results}
        if len(ok) == len(targets):
            return JSONResponse({"object": "lora_adapter", "lora_name": req.lora_name,
                                 "workers": per_worker})
        status = statuses.pop() if len(statuses) == 1 else 502
        first = next(r for s, r in results if s >= 300)
        error = first.get("error") if isinstance(first, dict) else None
        return JSONResponse({"error": error or {"message": f"{len(targets) - len(ok)} of "
                                                           f"{len(targets)} workers failed",
                                                "type": "server_error", "param": None,
                                                "code": status},
                             "workers": per_worker}, status_code=status)

    @app.post(LOAD_PATH)
    async def load(request: Request) -> JSONResponse:
        return await fan_out(LOAD_PATH, request, LoadLoRAAdapterRequest)

    @app.post(UNLOAD_PATH)
    async def unload(request: Request) -> JSONResponse:
        return await fan_out(UNLOAD_PATH, request, UnloadLoRAAdapterRequest)


def _apply(w: Worker, path: str, name: str, result: Any) -> None:
    """Routing learns a worker's load or unload at once: from the adapter set its answer
    reports (versioned, so no probe answered before it can undo it), else (an older
    worker) by adding or removing the name."""
    report = LoRAReport.from_json(result.get("lora") if isinstance(result, dict) else None)
    if report is not None and report.version is not None:
        w.apply_lora_report(report)
    elif w.lora_version is None:
        digests = dict(w.lora_digests)
        if path == LOAD_PATH:
            digests.setdefault(name, "")
        else:
            digests.pop(name, None)
        w.apply_lora_report(LoRAReport(digests))


async def _call(http: httpx.AsyncClient, w: Worker, path: str, body: bytes,
                headers: dict[str, str]) -> tuple[int, Any]:
    """(status, JSON body) of one worker's answer; 502 when it gave none."""
    try:
        r = await http.post(w.id + path, content=body, headers=headers, timeout=TIMEOUT_S)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text[:512]}}
    except httpx.HTTPError as exc:
        return 502, {"error": {"message": f"{w.id}: {type(exc).__name__}: {exc}"[:512],
                               "type": "server_error"}}
