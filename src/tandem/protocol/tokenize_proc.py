"""A tokenizer in a helper process, for an event loop that must not share its GIL.

`Tokenizer.encode_async` can run the tokenizer's own call on a worker thread, but a thread
that finishes needs the GIL back: every place the loop lets go of it (a socket call, an RE2
match) wakes that thread, which mostly loses the race and waits until the loop idles. A
busy loop pays for the wake-ups and the request for the wait. `TokenizeProcess` runs the
same tokenizer (`Tokenizer.load` on the same path) in a child process instead: the loop
writes the texts to the child's stdin and reads the ids back as one more socket event.

Frames, little-endian, no pickle: a request is `<u32 id, u32 flags, u32 size>` then `size`
bytes of texts, each `<u32 n>` and `n` bytes of UTF-8 (`flags` bit 0: add special tokens);
an answer is `<u32 id, u32 status, u32 size>` then, per text, `<u32 count>` and `count`
u32 ids (`status` 1: the child could not encode; the body is its UTF-8 message). The child
writes the id `READY` first, once its tokenizer is loaded. Requests are answered in order.
A child that gives no answer within `ANSWER_TIMEOUT_S` (more for long texts) is killed.

    python -m tandem.protocol.tokenize_proc PATH
"""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
import time
from array import array

logger = logging.getLogger(__name__)

HEAD = struct.Struct("<III")
COUNT = struct.Struct("<I")
READY = 0xFFFFFFFF  # the first answer's id: the tokenizer is loaded
MAX_FRAME = 256 << 20  # bytes of one frame either way
RESTART_AFTER_S = 5.0  # a child that died is started again no sooner than this
# an answer later than this (plus a second per `CHARS_PER_S` characters sent) means the child
# is stuck: it is killed and the caller encodes in-process (the tokenizer does ~8M chars/s)
ANSWER_TIMEOUT_S = 2.0
CHARS_PER_S = 50_000


class TokenizeError(Exception):
    """The helper could not answer (not started, gone, or refused the texts): the caller
    encodes in its own process instead."""


def _texts_frame(rid: int, texts: list[str], special: bool) -> bytes:
    parts = []
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        parts.append(COUNT.pack(len(b)))
        parts.append(b)
    body = b"".join(parts)
    return HEAD.pack(rid, int(special), len(body)) + body


def _ids_of(body: bytes, n: int) -> list[list[int]]:
    out, at = [], 0
    view = memoryview(body)
    for _ in range(n):
        (count,) = COUNT.unpack_from(body, at)
        at += 4
        ids = array("I")
        ids.frombytes(view[at:at + 4 * count])
        if sys.byteorder != "little":
            ids.byteswap()
        out.append(ids.tolist())
        at += 4 * count
    if at != len(body):
        raise TokenizeError("a malformed answer from the tokenizer process")
    return out


class TokenizeProcess:
    """The tokenizer at `source` in a child process, started on first use on the calling
    event loop and again (no sooner than `RESTART_AFTER_S` after it died) when it goes.
    `encode` raises `TokenizeError` while it is not ready: the caller falls back."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = False
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}  # id -> (future, texts)
        self._next = 0
        self._died_at = float("-inf")
        self._reader: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        """Start the child now (on the running loop) unless it runs or died just now."""
        if (self._reader is not None and not self._reader.done()
                or time.monotonic() - self._died_at < RESTART_AFTER_S):
            return
        self._reader = asyncio.get_running_loop().create_task(self._run())

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The ids of each text, as `Tokenizer.backend.encode_batch` gives them."""
        proc = self._proc
        if not self._ready or proc is None or proc.stdin is None:
            self.start()
            raise TokenizeError("the tokenizer process is not ready")
        rid = self._next
        self._next = (self._next + 1) % READY
        frame = _texts_frame(rid, texts, add_special_tokens)
        if len(frame) > MAX_FRAME:
            raise TokenizeError("texts over the tokenizer process's frame bound")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, len(texts))
        try:
            try:
                proc.stdin.write(frame)
            except (RuntimeError, OSError) as exc:  # its pipe closed: it is going
                raise TokenizeError(f"the tokenizer process's pipe: {exc}") from None
            limit = ANSWER_TIMEOUT_S + sum(map(len, texts)) / CHARS_PER_S
            try:
                return await asyncio.wait_for(fut, limit)
            except TimeoutError:  # stuck (or stopped): its reader restarts it later
                logger.warning("tokenizer process %d gave no answer in %.1f s: killed",
                               proc.pid, limit)
                if proc.returncode is None:
                    proc.kill()
                raise TokenizeError("the tokenizer process did not answer in time") from None
        finally:
            self._pending.pop(rid, None)

    async def _run(self) -> None:
        proc = None
        try:
            self._proc = proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.protocol.tokenize_proc", self.source,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 20)
            assert proc.stdout is not None
            while True:
                rid, status, size = HEAD.unpack(await proc.stdout.readexactly(HEAD.size))
                if size > MAX_FRAME:
                    raise TokenizeError(f"an answer of {size} bytes")
                body = await proc.stdout.readexactly(size)
                if rid == READY:
                    self._ready = True
                    logger.info("tokenizer process %d ready (%s)", proc.pid, self.source)
                    continue
                got = self._pending.get(rid)
                if got is None or got[0].done():
                    continue  # its caller went away
                fut, n = got
                if status:
                    fut.set_exception(TokenizeError(body.decode("utf-8", "replace")[:300]))
                else:
                    fut.set_result(_ids_of(body, n))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EOF (it died), a malformed frame, a failed start
            logger.warning("tokenizer process (%s) stopped: %s; encoding in-process until it "
                           "restarts", self.source, exc or type(exc).__name__)
        finally:
            self._ready = False
            self._died_at = time.monotonic()
            for fut, _ in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(TokenizeError("the tokenizer process stopped"))
            self._proc = None
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None


def _serve(path: str) -> int:
    import signal

    from tandem.protocol.tokenizer import Tokenizer

    # the parent's Ctrl-C reaches its whole process group: it drains, then closes our stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    backend = Tokenizer.load(path).backend
    fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    fout.write(HEAD.pack(READY, 0, 0))
    fout.flush()
    while True:
        head = fin.read(HEAD.size)
        if len(head) < HEAD.size:
            return 0  # the parent closed our stdin: it is gone
        rid, flags, size = HEAD.unpack(head)
        body = fin.read(size)
        if len(body) < size:
            return 0
        try:
            texts, at = [], 0
            while at < size:
                (n,) = COUNT.unpack_from(body, at)
                texts.append(body[at + 4:at + 4 + n].decode("utf-8", "surrogatepass"))
                at += 4 + n
            parts = []
            for enc in fast(texts, add_special_tokens=bool(flags & 1)):
                ids = array("I", enc.ids)
                if sys.byteorder != "little":
                    ids.byteswap()
                parts.append(COUNT.pack(len(ids)))
                parts.append(ids.tobytes())
            out, status = b"".join(parts), 0
        except Exception as exc:  # a text the tokenizer refuses: said, and the next frame
            out, status = str(exc).encode()[:300], 1
        fout.write(HEAD.pack(rid, status, len(out)) + out)
        fout.flush()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
