"""The user-facing API and model pages stay true to the code.

`docs/openai-api.md`: every request field of the OpenAI models is documented, the endpoint
table names exactly the routes the worker's and the router's apps register (and who serves
each), every row of its refused-fields table is refused with that exact message, every field
it lists as unsupported (and any unknown name) gets exactly the documented 400 from the
worker's app, and the fields it accepts without effect are the code's allow-list and are
accepted. `docs/supported-models.md`: the architectures it lists
are the loaders' registries.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from tandem.protocol import openai_api as api
from tandem.protocol.responses_api import ResponsesRequest

DOCS = Path(__file__).resolve().parents[1] / "docs"
API_PAGE = DOCS / "openai-api.md"
MODELS_PAGE = DOCS / "supported-models.md"


def _page(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The data rows (cells stripped) of the first Markdown table after `marker`."""
    rows: list[list[str]] = []
    started = False
    for line in text[text.index(marker):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


def _code(cell: str) -> str:
    m = re.fullmatch(r"`(.*)`", cell)
    assert m, f"expected one code span, got {cell!r}"
    return m.group(1)


# -- request fields ----------------------------------------------------------------------
DOCUMENTED_MODELS: tuple[type[BaseModel], ...] = (
    api.CompletionRequest, api.ChatCompletionRequest, api.ChatMessage, api.TextPart,
    api.StreamOptions, api.TokenizeRequest, api.DetokenizeRequest, ResponsesRequest)


@pytest.mark.parametrize("model", DOCUMENTED_MODELS, ids=lambda m: m.__name__)
def test_every_request_field_is_documented(model: type[BaseModel]) -> None:
    text = _page(API_PAGE)
    missing = [f for f in model.model_fields if f"`{f}`" not in text and f'"{f}"' not in text]
    assert not missing, f"{model.__name__} fields not in docs/openai-api.md: {missing}"


# -- endpoints ---------------------------------------------------------------------------
def _worker_routes() -> set[tuple[str, str]]:
    from tandem.serving.api_server import ServerSettings, build_app

    app = build_app(ServerSettings(served_model_name="m"), lambda: None)  # never started
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}


def _router_routes() -> set[tuple[str, str]]:
    from tandem.router.app import RouterServerSettings, build_app
    from tandem.router.core import Router, RouterSettings

    app = build_app(Router(RouterSettings(), lambda _: None), RouterServerSettings(openapi=True))
    return {(m, r.path) for r in app.app.routes for m in getattr(r, "methods", ())}


def _endpoint_table() -> dict[tuple[str, str], tuple[bool, bool]]:
    """(method, path) -> (router serves it, worker serves it), from the page's table."""
    out = {}
    for method, paths, router, worker, _auth in _table_after(_page(API_PAGE), "## Endpoints"):
        for path in re.findall(r"`([^`]+)`", paths):
            out[(method, path)] = (not router.startswith("no"), not worker.startswith("no"))
    return out


def test_endpoint_table_matches_the_apps_routes() -> None:
    table = _endpoint_table()
    worker, router = _worker_routes(), _router_routes()
    for route in worker | router:
        assert route in table, f"{route} is served but not in the endpoint table"
    for route, (on_router, on_worker) in table.items():
        assert (route in router) == on_router, f"{route}: the table says router={on_router}"
        assert (route in worker) == on_worker, f"{route}: the table says worker={on_worker}"


# -- refused and accepted fields ---------------------------------------------------------
_BASE = {"completions": {"model": "m", "prompt": "hi"},
         "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _refusal(kind: str, body: dict) -> str | None:
    """The worker's 400 message for `body`, from the same code the endpoints run (schema,
    then sampling parameters, then the prompt list); None when it is accepted."""
    from tandem.engine.errors import InvalidRequestError
    from tandem.protocol.web import first_error
    from tandem.serving.convert import completion_prompts, sampling_params

    model = api.CompletionRequest if kind == "completions" else api.ChatCompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        return first_error(exc)
    try:
        sampling_params(req, 16)  # the worker's default --max-n
        if isinstance(req, api.CompletionRequest):
            completion_prompts(req)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def _refused_rows() -> list[tuple[str, dict, str]]:
    rows = _table_after(_page(API_PAGE), "<!-- refused-table")
    assert len(rows) >= 10
    return [(kind, json.loads(_code(body)), _code(msg)) for kind, body, msg in rows]


@pytest.mark.parametrize("kind,extra,message", _refused_rows(),
                         ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_refused_fields_are_refused_with_the_documented_message(kind: str, extra: dict,
                                                                message: str) -> None:
    assert _refusal(kind, {**_BASE[kind], **extra}) == message


def _unsupported_fields() -> list[str]:
    rows = _table_after(_page(API_PAGE), "<!-- unsupported-fields")
    fields = [f for cells in rows for f in re.findall(r"`([a-z_]+)`", cells[0])]
    assert len(fields) >= 20
    return fields


def _worker_answer(kind: str, body: dict) -> tuple[int, dict]:
    """The worker app's HTTP answer to `body` (in-process; a body the schema refuses never
    reaches the engine, which this app does not have)."""
    from fastapi.testclient import TestClient

    from tandem.serving.api_server import ServerSettings, build_app

    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    app = build_app(ServerSettings(served_model_name="m"), lambda: None)
    r = TestClient(app, raise_server_exceptions=False).post(path, json=body)
    return r.status_code, r.json()


def unsupported(field: str) -> tuple[int, dict]:
    """The documented answer to a field Tandem does not support."""
    return 400, {"error": {"message": f"{field} is not supported",
                           "type": "invalid_request_error", "param": field, "code": 400}}


@pytest.mark.parametrize("field", [*_unsupported_fields(), "unknown"])
def test_unsupported_fields_get_the_documented_400(field: str) -> None:
    """Each listed field (and a random name) on both endpoints: exactly the documented 400;
    null means not sent."""
    if field == "unknown":
        field = f"x_{random.randrange(1 << 30):x}"
    for kind, model in (("completions", api.CompletionRequest),
                        ("chat", api.ChatCompletionRequest)):
        assert field not in model.model_fields, f"{field} is a field now: document it"
        assert _worker_answer(kind, {**_BASE[kind], field: {"x": 1}}) == unsupported(field)
        assert _refusal(kind, {**_BASE[kind], field: None}) is None


def test_empty_tools_functions_and_logit_bias_mean_not_sent() -> None:
    text = " ".join(_page(API_PAGE).split())
    named = re.search(r"empty `(\w+)`, `(\w+)` or `(\w+)` \(`\[\]` or `\{\}`\), are taken "
                      r"as not sent", text)
    assert named and set(named.groups()) == api.EMPTY_MEANS_UNUSED
    models = {"completions": api.CompletionRequest, "chat": api.ChatCompletionRequest}
    for field in api.EMPTY_MEANS_UNUSED:
        for kind in _BASE:
            for empty in ([], {}):
                assert _refusal(kind, {**_BASE[kind], field: empty}) is None
            if field not in models[kind].model_fields:  # (chat's `tools`: a field)
                assert _worker_answer(kind, {**_BASE[kind], field: [{}]}) == unsupported(field)


def _accepted_rows() -> list[tuple[str, str, dict]]:
    rows = _table_after(_page(API_PAGE), "<!-- accepted-without-effect")
    return [(re.match(r"`(\w+)`", field).group(1), kind, json.loads(_code(body)))
            for field, kind, body, _why in rows]


def test_accepted_without_effect_is_the_codes_allow_list() -> None:
    assert {field for field, _, _ in _accepted_rows()} == api.ACCEPTED_WITHOUT_EFFECT


@pytest.mark.parametrize("field,kind,body", _accepted_rows(), ids=lambda v: v
                         if isinstance(v, str) else None)
def test_accepted_without_effect_fields_are_accepted(field: str, kind: str,
                                                     body: dict) -> None:
    assert field in json.dumps(body)
    kinds = list(_BASE) if kind == "both" else [kind]
    for k in kinds:
        assert _refusal(k, {**_BASE[k], **body}) is None
    for k in set(_BASE) - set(kinds) if field in body else ():  # elsewhere: refused
        assert _worker_answer(k, {**_BASE[k], **body}) == unsupported(field)


# -- supported models --------------------------------------------------------------------
def _listed_architectures() -> dict[str, set[str]]:
    """Column -> names, from the architectures table of docs/supported-models.md."""
    rows = _table_after(_page(MODELS_PAGE), "<!-- architectures-table")
    out: dict[str, set[str]] = {"engine": set(), "hf": set(), "gguf": set()}
    for engine, hf, gguf, *_ in rows:
        out["engine"].add(_code(engine))
        out["hf"].update(re.findall(r"`([^`]+)`", hf))
        out["gguf"].update(re.findall(r"`([^`]+)`", gguf))
    return out


def test_supported_architectures_match_the_loaders() -> None:
    from tandem.engine.model.config import SUPPORTED_ARCHITECTURES
    from tandem.engine.model.gguf_loader import GGUF_ARCHITECTURES
    from tandem.engine.model.hf_loader import HF_ARCHITECTURES, HF_MODEL_TYPES

    listed = _listed_architectures()
    assert listed["engine"] == set(SUPPORTED_ARCHITECTURES)
    assert listed["hf"] == set(HF_ARCHITECTURES) | {f"model_type: {t}" for t in HF_MODEL_TYPES}
    assert listed["gguf"] == set(GGUF_ARCHITECTURES)


def test_unsupported_architecture_message_is_the_documented_one(tmp_path: Path) -> None:
    from tandem.engine.errors import ConfigError
    from tandem.engine.model.hf_loader import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}))
    with pytest.raises(ConfigError) as err:
        config_from_hf(tmp_path)
    shown = str(err.value).replace(str(tmp_path), "/models/gemma-2b")
    assert f"`{shown}`" in _page(MODELS_PAGE)


# -- troubleshooting ---------------------------------------------------------------------
# literal parts of the messages docs/troubleshooting.md quotes; each must still be what the
# code says (string literals joined across lines) and what the page says
TROUBLESHOOTING_MESSAGES = (
    "is a directory without config.json; expected a Hugging Face model directory",
    "unsupported model file; expected a .gguf file or a Hugging Face directory",
    "no *.safetensors files (only safetensors is supported)",
    "not a readable GGUF file",
    "needs CUDA, but this torch build",
    "is CPU-only; install a CUDA build of torch (e.g. the tandem CUDA image) or use --device cpu",
    "no C compiler found; using the pure-torch CPU path",
    "; using pure torch",
    "exceeds the KV cache capacity of",
    "and at least one must be left to generate",
    "; lower gpu_memory_utilization or free memory held by other processes",
    "no GPU memory left for the KV cache: ",
    "sequence needs; raise gpu_memory_utilization (or kv_cache_memory bytes) or lower "
    "max_model_len to at most",
    "this model has no chat template",
    "does not exist.",
    "is not served here",
    "missing or malformed Authorization: Bearer <key>",
    "invalid API key",
    "this API key may not load or unload adapters",
    "must come from the router",
    "rate limit exceeded (",
    "more than this tenant's tokens per minute; lower max_tokens or n",
    "no ready worker serves this model; retry later",
    "the router is starting: ",
    "ready yet (starting, draining or failing probes); retry later",
    "the model is loading",
    "request timed out after",
    "has no tokenizer: routed approximately on text hashes (no cache-aware prefix scoring, "
    "no shared index)",
    "no tokenizer for them (--tokenizer PATH or router.yaml tokenizers)",
    "exiting: the model failed to load",
    "does not exist",
    "is already in use",
    "expected pvc://, hf://, file:// or ",
)


def _joined_source() -> str:
    src = Path(__file__).resolve().parents[1] / "src" / "tandem"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(src.rglob("*.py")))
    return re.sub(r"([\"'])\s*\n\s*(?:rf|fr|f|r)?\1", "", text)  # "a "\n  f"b" -> "ab"


def test_troubleshooting_messages_are_the_codes() -> None:
    source = _joined_source()
    page = " ".join(_page(DOCS / "troubleshooting.md").split())
    for fragment in TROUBLESHOOTING_MESSAGES:
        assert fragment in source, f"no longer in the code: {fragment!r}"
        assert fragment in page, f"not in docs/troubleshooting.md: {fragment!r}"
