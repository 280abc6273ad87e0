"""A character-at-a-time JSON validator (a pushdown automaton), for streaming tool calls.

`JsonScanner.push(ch)` accepts one character of a JSON object or array and says whether the
text so far is still a prefix of valid JSON; once the top-level value closes, `done` is set.
So a stream can forward a value's raw characters as they arrive and the concatenation is
valid JSON whenever the value completes. It also reports, for the top-level object, where
each member's key and value start and end (`Event`), which is what a tool-call streamer
needs to find `"name"` and `"arguments"` without holding the whole call.
"""

from __future__ import annotations

import enum

MAX_DEPTH = 256  # nesting past this is refused (the stack is the scanner's only memory)

_WS = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_DIGITS = "0123456789"


class Event(enum.Enum):
    """What a character did at depth 1 (a member of the top-level container)."""

    NONE = 0
    KEY_START = 1  # the opening quote of a top-level object's key
    KEY_END = 2  # its closing quote
    VALUE_START = 3  # the first character of a top-level member's (or element's) value
    VALUE_END = 4  # the last character of that value (for a number: the one after it)
    CLOSED = 5  # the top-level container closed (`done`)


class _S(enum.Enum):
    START = 0  # before the top-level `{` / `[`
    VALUE = 1  # a value expected
    KEY_OR_CLOSE = 2  # after `{`
    KEY = 3  # after `,` in an object
    COLON = 4
    VALUE_OR_CLOSE = 5  # after `[`
    AFTER = 6  # after a value: `,` or a close
    STRING = 7
    NUMBER = 8
    LITERAL = 9
    DONE = 10


# number DFA: state -> {character class -> next}; accepting states end a number
_NUM = {
    "start": {"-": "minus", "0": "zero", "d": "int"},
    "minus": {"0": "zero", "d": "int"},
    "zero": {".": "dot", "e": "e"},
    "int": {"0": "int", "d": "int", ".": "dot", "e": "e"},
    "dot": {"0": "frac", "d": "frac"},
    "frac": {"0": "frac", "d": "frac", "e": "e"},
    "e": {"+": "esign", "-": "esign", "0": "exp", "d": "exp"},
    "esign": {"0": "exp", "d": "exp"},
    "exp": {"0": "exp", "d": "exp"},
}
_NUM_ACCEPT = frozenset({"zero", "int", "frac", "exp"})


def _num_class(ch: str) -> str:
    if ch == "0":
        return "0"
    if ch in _DIGITS:
        return "d"
    if ch in "eE":
        return "e"
    return ch


class JsonScanner:
    """Validates one JSON object or array (the top-level value must be a container)."""

    def __init__(self, max_depth: int = MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self._stack: list[str] = []  # "{" / "["
        self._state = _S.START
        self._is_key = False  # the string being read is an object key
        self._escape = 0  # 0: none; 1: after `\`; 2..5: hex digits of `\u` still expected
        self._num = "start"
        self._lit = ""  # the rest of `true` / `false` / `null`
        self.done = False
        self.error = False

    @property
    def depth(self) -> int:
        return len(self._stack)

    def push(self, ch: str) -> Event:
        """Consume one character. Sets `error` (and returns NONE) when the text stops being
        a prefix of valid JSON; every later push is an error too."""
        if self.error:
            return Event.NONE
        try:
            return self._push(ch)
        except _Invalid:
            self.error = True
            return Event.NONE

    def _push(self, ch: str) -> Event:
        s = self._state
        if s is _S.STRING:
            return self._string(ch)
        if s is _S.NUMBER:
            cls = _num_class(ch)
            nxt = _NUM[self._num].get(cls)
            if nxt is not None:
                self._num = nxt
                return Event.NONE
            if self._num not in _NUM_ACCEPT:
                raise _Invalid
            ended = self._value_done()  # the number ended before `ch`; `ch` follows it
            follow = self._push(ch)
            return ended if follow is Event.NONE else follow
        if s is _S.LITERAL:
            if ch != self._lit[0]:
                raise _Invalid
            self._lit = self._lit[1:]
            return self._value_done() if not self._lit else Event.NONE
        if ch in _WS:
            return Event.NONE
        if s is _S.DONE:
            raise _Invalid
        if s is _S.START:
            if ch not in "{[":
                raise _Invalid
            return self._open(ch, top=True)
        if s is _S.KEY_OR_CLOSE and ch == "}":
            return self._close()
        if s in (_S.KEY_OR_CLOSE, _S.KEY):
            if ch != '"':
                raise _Invalid
            self._state, self._is_key = _S.STRING, True
            return Event.KEY_START if self.depth == 1 else Event.NONE
        if s is _S.COLON:
            if ch != ":":
                raise _Invalid
            self._state = _S.VALUE
            return Event.NONE
        if s is _S.VALUE_OR_CLOSE and ch == "]":
            return self._close()
        if s in (_S.VALUE, _S.VALUE_OR_CLOSE):
            return self._value_start(ch)
        # AFTER
        top = self._stack[-1]
        if ch == ",":
            self._state = _S.KEY if top == "{" else _S.VALUE
            return Event.NONE
        if (ch == "}" and top == "{") or (ch == "]" and top == "["):
            return self._close()
        raise _Invalid

    def _value_start(self, ch: str) -> Event:
        at_top = self.depth == 1
        if ch in "{[":
            self._open(ch, top=False)
        elif ch == '"':
            self._state, self._is_key = _S.STRING, False
        elif ch == "-" or ch in _DIGITS:
            self._state, self._num = _S.NUMBER, _NUM["start"][_num_class(ch)]
        elif ch in "tfn":
            self._state = _S.LITERAL
            self._lit = {"t": "rue", "f": "alse", "n": "ull"}[ch]
        else:
            raise _Invalid
        return Event.VALUE_START if at_top else Event.NONE

    def _open(self, ch: str, top: bool) -> Event:
        if len(self._stack) >= self.max_depth:
            raise _Invalid
        self._stack.append(ch)
        self._state = _S.KEY_OR_CLOSE if ch == "{" else _S.VALUE_OR_CLOSE
        return Event.NONE

    def _close(self) -> Event:
        self._stack.pop()
        if not self._stack:
            self._state = _S.DONE
            self.done = True
            return Event.CLOSED
        return self._value_done()

    def _value_done(self) -> Event:
        """A value (scalar, or a container just closed) ended at the current depth."""
        self._state = _S.AFTER
        return Event.VALUE_END if self.depth == 1 else Event.NONE

    def _string(self, ch: str) -> Event:
        if self._escape == 1:
            if ch not in _ESCAPES:
                raise _Invalid
            self._escape = 5 if ch == "u" else 0
            return Event.NONE
        if self._escape > 1:
            if ch not in _HEX:
                raise _Invalid
            self._escape = 0 if self._escape == 2 else self._escape - 1
            return Event.NONE
        if ch == "\\":
            self._escape = 1
            return Event.NONE
        if ch == '"':
            if self._is_key:
                self._state = _S.COLON
                return Event.KEY_END if self.depth == 1 else Event.NONE
            return self._value_done()
        if ord(ch) < 0x20:
            raise _Invalid
        return Event.NONE


class _Invalid(Exception):
    pass
