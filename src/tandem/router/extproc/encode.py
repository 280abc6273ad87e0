"""The endpoint-picker protocol's messages, built from and read into plain values.

* The pick: a request-headers `HeadersResponse` whose header mutation sets
  `x-gateway-destination-endpoint` (in `raw_value` only: Envoy reads `raw_value` and refuses a
  mutation that sets both) to the endpoints, and the identical dynamic metadata
  `envoy.lb` / `x-gateway-destination-endpoint`: `ip:port` of the pick, then its fallbacks, in
  order, comma-separated. Route cache cleared, so the gateway re-routes on the new header.
* Bodies go back as `StreamedBodyResponse` chunks of at most `BODY_CHUNK` bytes (in
  FULL_DUPLEX_STREAMED mode the upstream and the client receive only what the EPP returns).
* The gateway's inputs: the subset hint (`envoy.lb.subset_hint` /
  `x-gateway-destination-endpoint-subset`: a list or a comma-separated string) and the served
  endpoint (`envoy.lb` / `x-gateway-destination-endpoint-served`), from the request's
  `metadata_context.filter_metadata`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from tandem.protocol.web import error_body

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NS = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NS = "envoy.lb.subset_hint"
SERVED = "x-gateway-destination-endpoint-served"
BODY_CHUNK = 62000  # bytes per streamed chunk (some gateways cap a chunk at 64 KiB)
MAX_SUBSET = 4096  # endpoints read from one subset hint


def endpoint(url: str) -> str:
    """A worker's base URL as the protocol names endpoints: `ip:port` (`[v6]:port`)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    """Header name (lower case) -> value (`raw_value`, else `value`); a repeated header's
    values joined with "," (as HTTP folds them)."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    """One header to set (replacing any the request carries), value in `raw_value` only."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def pick_response(endpoints: list[str], headers: Mapping[str, str],
                  remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    """The request-headers answer naming `endpoints` (pick first) in the destination header
    and the `envoy.lb` metadata alike, with `headers` set and `remove` removed."""
    value = ",".join(endpoints)
    sets = [header_option(DESTINATION, value), *(header_option(k, v) for k, v in headers.items())]
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NS].struct_value.fields[DESTINATION].string_value = value
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            clear_route_cache=True,
            header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=list(remove)))),
        dynamic_metadata=metadata)


def body_responses(body: bytes, request: bool, end_of_stream: bool = True
                   ) -> list[pb.ProcessingResponse]:
    """`body` as streamed body answers (`request`: of the request, else of the response),
    `BODY_CHUNK` bytes each; the last carries `end_of_stream`. An empty body is one empty
    chunk."""
    pieces = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    out = []
    for n, piece in enumerate(pieces):
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(
                body=piece, end_of_stream=end_of_stream and n == len(pieces) - 1)))
        answer = pb.BodyResponse(response=common)
        out.append(pb.ProcessingResponse(request_body=answer) if request
                   else pb.ProcessingResponse(response_body=answer))
    return out


def pass_headers(request: bool, headers: Mapping[str, str] | None = None
                 ) -> pb.ProcessingResponse:
    """Headers passed on (`request`: the request's, else the response's), unchanged but for
    `headers` set (`raw_value` only)."""
    common = pb.CommonResponse()
    if headers:
        common.header_mutation.set_headers.extend(header_option(k, v)
                                                  for k, v in headers.items())
    answer = pb.HeadersResponse(response=common)
    return (pb.ProcessingResponse(request_headers=answer) if request
            else pb.ProcessingResponse(response_headers=answer))


def immediate(status: int, body: bytes, headers: Mapping[str, str] | None = None,
              details: str = "") -> pb.ProcessingResponse:
    """The gateway answers the client itself: `status`, `headers`, `body`."""
    sets = [header_option(k, v) for k, v in (headers or {}).items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=sets), body=body, details=details))


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None, type_: str | None = None,
                   code: str | None = None) -> pb.ProcessingResponse:
    """An OpenAI error answer (`protocol.web.error_body`; `code` its `code`, None: the
    status) as an immediate response."""
    return error_doc(status, error_body(status, message, param, type_, code), headers)


def error_doc(status: int, doc: Mapping, headers: Mapping[str, str] | None = None
              ) -> pb.ProcessingResponse:
    """An error body already built (`doc`, JSON) as an immediate response."""
    return immediate(status, json.dumps(doc).encode(),
                     {"content-type": "application/json", **(headers or {})},
                     details=f"tandem_epp_{status}")


def _metadata(req: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    fields = req.metadata_context.filter_metadata
    if namespace not in fields:
        return None
    inner = fields[namespace].fields
    return inner.get(key)


def _strings(value: struct_pb2.Value) -> list[str] | None:
    """A string or list-of-strings value split on commas (None: another kind)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        raw = [value.string_value]
    elif kind == "list_value":
        raw = [v.string_value for v in value.list_value.values[:MAX_SUBSET]
               if v.WhichOneof("kind") == "string_value"]
    else:
        return None
    return [p.strip() for s in raw for p in s.split(",") if p.strip()][:MAX_SUBSET]


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows (None: no hint; [] a hint allowing none)."""
    value = _metadata(req, SUBSET_NS, SUBSET)
    if value is None:
        return None
    return _strings(value) or []


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway reports as having served the request, if any."""
    value = _metadata(req, DESTINATION_NS, SERVED)
    got = _strings(value) if value is not None else None
    return got[0] if got else None


def in_subset(ep: str, allowed: Iterable[str]) -> bool:
    """Whether endpoint `ep` (`ip:port`) is allowed: listed as `ip:port`, or its host listed
    alone (any port), as the reference picker reads the hint."""
    host = ep.rsplit(":", 1)[0]
    names = {ep, host, host.strip("[]")}
    return any(a in names for a in allowed)
