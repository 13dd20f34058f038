"""JSON read as far as the text goes: a reply still streaming ends mid-value.

The chat parsers (chat_parse.py) need to know, of a reply cut anywhere, which object members
are complete, where a value ends, and what a string says so far, without ever deciding
something the next characters could change. Invalid JSON is not an error here: a container
that stops being JSON just never ends.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass

_WS = " \t\n\r"


class _Invalid(Exception):
    pass


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote
_STRING_STOP = re.compile(r'["\\]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _value_end(s: str, i: int) -> int | None:
    """End of the JSON value at s[i]; None when the text ends inside it (or could still
    continue it, as a number at the very end); _Invalid when it is not JSON."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = _STRING_BODY.match(s, i + 1).end()  # type: ignore[union-attr]
        return j + 1 if j < len(s) and s[j] == '"' else None
    if c in "{[":
        _, end = object_members(s, i) if c == "{" else array_items(s, i)
        return end
    if c in "-0123456789":
        j = i
        while j < len(s) and s[j] in "+-.eE0123456789":
            j += 1
        if j == len(s):
            return None
        if not _NUMBER.fullmatch(s, i, j):
            raise _Invalid
        return j
    for lit in ("true", "false", "null"):
        if s.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(s[i:]):
            return None
    raise _Invalid


@dataclass(slots=True)
class Member:
    key: str
    start: int  # where the value starts
    end: int | None  # where it ends; None: not complete yet


def object_members(s: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the object at s[i] as far as the text goes, and the object's end
    (None: not complete, or not JSON from some point on: such an object never ends). A member
    appears once its key is complete; its `end` once its value is."""
    out: list[Member] = []
    try:
        i = skip_ws(s, i + 1)
        if i < len(s) and s[i] == "}":
            return out, i + 1
        while i < len(s):
            if s[i] != '"':
                raise _Invalid
            k_end = _value_end(s, i)
            if k_end is None:
                break
            key = json.loads(s[i:k_end], strict=False)
            i = skip_ws(s, k_end)
            if i < len(s) and s[i] != ":":
                raise _Invalid
            i = skip_ws(s, i + 1)
            if i >= len(s):
                break
            m = Member(key, i, None)
            out.append(m)
            m.end = _value_end(s, i)
            if m.end is None:
                break
            i = skip_ws(s, m.end)
            if i < len(s) and s[i] == "}":
                return out, i + 1
            if i < len(s) and s[i] != ",":
                raise _Invalid
            i = skip_ws(s, i + 1)
    except (_Invalid, ValueError):
        pass
    return out, None


def array_items(s: str, i: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """(start, end) of each item of the array at s[i] as far as the text goes, and its end;
    as `object_members`."""
    out: list[tuple[int, int | None]] = []
    try:
        i = skip_ws(s, i + 1)
        if i < len(s) and s[i] == "]":
            return out, i + 1
        while i < len(s):
            end = _value_end(s, i)
            out.append((i, end))
            if end is None:
                break
            i = skip_ws(s, end)
            if i < len(s) and s[i] == "]":
                return out, i + 1
            if i < len(s) and s[i] != ",":
                raise _Invalid
            i = skip_ws(s, i + 1)
    except _Invalid:
        pass
    return out, None


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


# what a partial string holds back: a high surrogate (its pair may follow) and an unfinished
# \u escape, each starting after an even run of backslashes (else it is an escaped backslash)
_HELD_ESCAPE = re.compile(r'(?<!\\)(?:\\\\)*((?:\\u[dD][89abAB][0-9a-fA-F]{2})?'
                          r'(?:\\u[0-9a-fA-F]{0,3}|\\)?)\Z')
_SURROGATE = re.compile("[\ud800-\udfff]")


def string_prefix(s: str, i: int, final: bool) -> tuple[str, bool]:
    """The decoded text of the JSON string at s[i] as far as it goes, and whether it is
    closed. A partial decode stops before an unfinished escape or a lone high surrogate (the
    next characters change what they mean); an unpaired surrogate is U+FFFD. Each streamed
    partial decodes the whole string again, so json.loads does it; `decode_string` is the
    slow reference it falls back to (a bad escape, which stays as written)."""
    end = _STRING_BODY.match(s, i + 1).end()  # type: ignore[union-attr]
    closed = end < len(s) and s[end] == '"'
    cut = end
    if not closed and not final:
        pos = max(i + 1, len(s) - 16)
        while pos > i + 1 and s[pos - 1] == "\\":  # from the start of a run of backslashes
            pos -= 1
        held = _HELD_ESCAPE.search(s, pos)
        cut = min(end, held.start(1)) if held else end
    try:
        text = json.loads('"' + s[i + 1 : cut] + '"', strict=False)
    except ValueError:
        return decode_string(s, i, final)
    return _SURROGATE.sub("\ufffd", text) + ("" if closed or not final else s[end:]), closed


def decode_string(s: str, i: int, final: bool) -> tuple[str, bool]:
    """`string_prefix`, a character at a time."""
    out: list[str] = []
    j = i + 1
    while j < len(s):
        stop = _STRING_STOP.search(s, j)
        if stop is None:
            out.append(s[j:])
            j = len(s)
            break
        out.append(s[j : stop.start()])
        j = stop.start()
        if s[j] == '"':
            return "".join(out), True
        if j + 1 >= len(s):
            break
        e = s[j + 1]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            j += 2
            continue
        if e != "u":
            out.append(s[j : j + 2])
            j += 2
            continue
        hexa = s[j + 2 : j + 6]
        if len(hexa) < 4 and all(h in string.hexdigits for h in hexa):
            break
        if len(hexa) < 4 or not all(h in string.hexdigits for h in hexa):
            out.append(s[j : j + 2])
            j += 2
            continue
        cp = int(hexa, 16)
        if 0xD800 <= cp < 0xDC00:  # a high surrogate: its pair follows
            low = s[j + 6 : j + 12]
            if len(low) < 6 and not final and "\\u".startswith(low[:2]):
                break
            if len(low) == 6 and low[:2] == "\\u" and all(h in string.hexdigits for h in low[2:]):
                lo = int(low[2:], 16)
                if 0xDC00 <= lo < 0xE000:
                    out.append(chr(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)))
                    j += 12
                    continue
        out.append("\ufffd" if 0xD800 <= cp < 0xE000 else chr(cp))  # unpaired: no UTF-8
        j += 6
    if final:
        out.append(s[j:])
    return "".join(out), False
