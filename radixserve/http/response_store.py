"""Stored responses of OpenAI's Responses API (`store`, `previous_response_id`, GET/DELETE).

Each stored response keeps its Response object (what `GET /v1/responses/{id}` returns) and
its conversation: the input items of every response before it in its `previous_response_id`
chain, its own input items, then its output items. A follow-up that names it sends only its
new items; the server rebuilds the whole conversation (oai_responses.py), and the prompt's
prefix is served from whatever cache tier still holds it.

Kept in memory, per server process, inside a `cache_salt` namespace: a lookup from another
namespace (or none) finds nothing, as a prompt of another salt shares no KV. Bounded, least
recently used first out (a lookup counts as a use): at most `MAX_RESPONSES` responses and
`MAX_CHARS` characters of JSON (each response counted with its whole conversation, so the
bound holds however much of a chain's items the entries share). A conversation's count is
kept with it, so a follow-up's is the previous one's plus its new items' (`items_chars`): no
turn serializes the whole chain again. A response past the bounds is gone: its id answers 404,
and a follow-up naming it 400 (OpenAI's `previous_response_not_found`). Lost on restart, and
kept by the server process that answered (router mode does not proxy GET/DELETE; in
`radixserve cluster` each replica has its own store). The store is touched from the event loop
(streams) and from worker threads (parsing, non-streamed answers): one lock guards it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_RESPONSES = 1024  # responses kept (all namespaces together)
MAX_CHARS = 256 << 20  # characters of JSON kept: responses plus their whole conversations


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]  # the Response object, as created (status completed/incomplete)
    conversation: list[dict[str, Any]]  # input items of the chain, then this one's output items
    chars: int  # what the entry counts against the bound: the response's and the conversation's
    conversation_chars: int = 0  # the conversation's `items_chars`


def _chars(obj: Any) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def items_chars(items: list[dict[str, Any]]) -> int:
    """The characters a list of items counts: each one's JSON and a separator. A
    conversation's is its predecessor's plus that of the items it adds."""
    return sum(_chars(item) + 1 for item in items)


class ResponseStore:
    """Response id -> `Stored`, per `cache_salt` namespace; LRU within the bounds. Entries are
    never changed once put (readers get them as they are and must not change them)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, salt: str, rid: str, response: dict[str, Any],
            conversation: list[dict[str, Any]], conversation_chars: int | None = None) -> bool:
        """Keep a response (False: larger than the whole budget, not kept); the least recently
        used ones make room. `conversation_chars`: the conversation's `items_chars`, when the
        caller knows it (the previous entry's plus the new items'); else it is counted here."""
        if conversation_chars is None:
            conversation_chars = items_chars(conversation)
        chars = _chars(response) + conversation_chars
        if chars > self.max_chars or self.max_responses <= 0:
            log.warning("response %s not stored: %d characters, the store holds %d", rid,
                        chars, self.max_chars)
            return False
        entry = Stored(response, conversation, chars, conversation_chars)
        with self._lock:
            old = self._entries.pop((salt, rid), None)
            if old is not None:
                self._chars -= old.chars
            while self._entries and (len(self._entries) >= self.max_responses
                                     or self._chars + chars > self.max_chars):
                _, gone = self._entries.popitem(last=False)
                self._chars -= gone.chars
            self._entries[(salt, rid)] = entry
            self._chars += chars
        return True

    def get(self, salt: str, rid: str) -> Stored | None:
        """The stored response, or None (unknown, evicted, deleted, or another namespace's)."""
        with self._lock:
            entry = self._entries.get((salt, rid))
            if entry is not None:
                self._entries.move_to_end((salt, rid))
            return entry

    def delete(self, salt: str, rid: str) -> bool:
        with self._lock:
            entry = self._entries.pop((salt, rid), None)
            if entry is None:
                return False
            self._chars -= entry.chars
            return True

    @property
    def chars(self) -> int:
        with self._lock:
            return self._chars
