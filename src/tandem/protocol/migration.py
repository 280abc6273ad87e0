"""The router-worker contract of request migration (token replay); torch-free.

A stream the router may migrate is forwarded with `TOKENS_HEADER: 1`: the worker then puts,
in every SSE event of the stream, a comment line (`TOKENS_COMMENT`) naming the output token
ids that event's data covers and the characters of generated text the client has after it:

    : tandem-tokens <sent_chars> <id>,<id>,...\\n
    data: {...}\\n\\n

(SSE comment lines are ignored by clients; the router strips them anyway.) A worker that
cannot resume such a stream exactly (n > 1, echo, a tool or reasoning parser holding text)
sends no comments: its streams are not migrated.

When the stream breaks, the router sends the same body to another worker with
`RESUME_HEADER: <id>;<created>;<sent_chars>;<token ids, base64 of uint32 little-endian>`:
that worker answers as the original stream would have gone on (same `id` and `created`, no
second role chunk, text from character `sent_chars`, usage counting every token).

Both headers act only under the router's valid signature (a request carrying either needs
one: 403 otherwise), so a client can neither ask for internal fields nor forge a resume; the
resume is bound into the signed target (`signed_target`: the forward target plus
`|resume:<sha256 of the header>`). The token-ids header is not bound: a worker that does not
know it verifies the same target and sends no token ids (its streams are then not migrated),
so routers and workers can be upgraded in either order.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

TOKENS_HEADER = "x-tandem-token-ids"
RESUME_HEADER = "x-tandem-resume"
TOKENS_COMMENT = ": tandem-tokens "
MAX_RESUME_TOKENS = 8192  # ~44 KB of header: within the worker's 64 KiB of headers
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_COUNT = re.compile(r"[0-9]{1,13}")  # created (seconds) and sent_chars: ASCII digits
_MAX_CREATED = 1 << 40
_MAX_PACKED = (4 * MAX_RESUME_TOKENS + 2) // 3 * 4  # base64 characters of the most ids


@dataclass(frozen=True)
class Resume:
    """What a resumed stream continues: the response `id` and `created` the client has,
    the characters of generated text it has (`sent_chars`) and the output token ids
    generated so far."""

    response_id: str
    created: int
    sent_chars: int
    token_ids: list[int]

    def encode(self) -> str:
        packed = struct.pack(f"<{len(self.token_ids)}I", *self.token_ids)
        return (f"{self.response_id};{self.created};{self.sent_chars};"
                f"{base64.b64encode(packed).decode('ascii')}")

    @classmethod
    def decode(cls, value: str) -> Resume:
        """Parse a `RESUME_HEADER` value; ValueError naming what is wrong."""
        parts = value.split(";")
        if len(parts) != 4:
            raise ValueError("expected <id>;<created>;<sent_chars>;<base64 token ids>")
        rid, created, sent, packed = parts
        if not _ID.fullmatch(rid):
            raise ValueError("bad response id")
        if not (_COUNT.fullmatch(created) and _COUNT.fullmatch(sent)) \
                or int(created) >= _MAX_CREATED:
            raise ValueError("created and sent_chars must be non-negative integers")
        if len(packed) > _MAX_PACKED:  # refused before it is decoded
            raise ValueError(f"at most {MAX_RESUME_TOKENS} token ids")
        try:
            raw = base64.b64decode(packed, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("token ids are not base64") from exc
        if not raw or len(raw) % 4 or len(raw) // 4 > MAX_RESUME_TOKENS:
            raise ValueError(f"between 1 and {MAX_RESUME_TOKENS} uint32 token ids expected")
        ids = list(struct.unpack(f"<{len(raw) // 4}I", raw))
        return cls(rid, int(created), int(sent), ids)


def signed_target(target: str | None, headers: Mapping[str, str]) -> str | None:
    """The signed target of a forwarded request: `target` (`web.forward_target`) bound to
    its resume header, if any (module doc)."""
    resume = headers.get(RESUME_HEADER)
    if resume is None:
        return target
    return f"{target or ''}|resume:{hashlib.sha256(resume.encode('latin-1')).hexdigest()}"


def tokens_comment(sent_chars: int, token_ids: list[int]) -> str:
    """The comment line a worker puts before an event's `data:` line."""
    return f"{TOKENS_COMMENT}{sent_chars} {','.join(map(str, token_ids))}\n"


def parse_tokens_comment(line: bytes) -> tuple[int, list[int]] | None:
    """(sent_chars, token ids) of a `tokens_comment` line (without its newline), or None
    when `line` is not a well-formed one."""
    if not line.startswith(TOKENS_COMMENT.encode()):
        return None
    sent, _, ids = line[len(TOKENS_COMMENT):].partition(b" ")
    try:
        return int(sent), [int(t) for t in ids.split(b",")] if ids else []
    except ValueError:
        return None
