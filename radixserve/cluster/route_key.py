"""The routing key of a request: its rendered prompt, in its cache namespace.

The ingress renders a chat request with the model's chat template (fetched once from a
replica's /props: `chat_template`, `bos_token`, `eos_token`), so a chat and a /completion
whose prompt is the same text route alike, as they share KV on a replica. A request the
template cannot render is keyed by its messages' text in order, which keeps the prefix
order of the conversation. `cache_salt` leads the key: tenants never match each other.
Requests that compute no prompt (GET routes, /tokenize, ...) have no key. A request with
OpenAI's `prompt_cache_key` is keyed by that string instead (in its salt's namespace): every
request with the key goes where the first went, unless that replica is overloaded (the router's
imbalance rule), whatever its prompt. The replica's own
rendering differs only where every request's does alike (a leading BOS it drops when the
tokenizer adds one) or at the very end (a trailing assistant message it continues), so the
key's prefixes are the prompt's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from radixserve.text.chat_template import ChatTemplate, flatten_content

CHAT_PATHS = frozenset({"/chat/completions", "/v1/chat/completions"})
COMPLETION_PATHS = frozenset({"/completion", "/completions", "/v1/completions"})
PROMPT_PATHS = CHAT_PATHS | COMPLETION_PATHS  # the routes with a routing key


def _prompt_text(prompt: Any) -> str:
    """A completion prompt as text: a string as is, token ids (or a mix) spelled out, a batch
    by its first prompt (the replica computes them all)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return "\x00ids:" + ",".join(map(str, prompt))
        first = prompt[0]
        if isinstance(first, (str, list)):
            return _prompt_text(first)
    return ""


def _chat_text(body: dict[str, Any], template: ChatTemplate | None,
               server_kwargs: dict[str, Any]) -> str:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return ""
    if template is not None:
        extra = body.get("chat_template_kwargs")
        variables = {"tools": body.get("tools"), **server_kwargs,
                     **(extra if isinstance(extra, dict) else {})}
        for name in ("messages", "add_generation_prompt"):  # the replica refuses these
            variables.pop(name, None)
        try:
            return template.render(msgs, **variables)
        except Exception:  # whatever the replica will say of it, the key falls back
            pass
    parts = [json.dumps(body.get("tools"), sort_keys=True)] if body.get("tools") else []
    for m in msgs:
        if isinstance(m, dict):
            try:
                content = flatten_content(m.get("content"))
            except ValueError:
                content = str(m.get("content"))
            parts.append(f"{m.get('role')}\x1f{content}")
    return "\x1e".join(parts)


def route_key(path: str, body: bytes, template: ChatTemplate | None,
              server_kwargs: dict[str, Any] | None = None) -> str | None:
    """`path` without --api-prefix; None when the request has no prompt to route by (a body
    the replica will refuse included: it answers the 400). `server_kwargs`: the server's
    --chat-template-kwargs, which the replica renders with too."""
    chat = path in CHAT_PATHS
    if not chat and path not in COMPLETION_PATHS:
        return None
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict):
            return None
        text = (_chat_text(obj, template, server_kwargs or {}) if chat
                else _prompt_text(obj.get("prompt")))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    salt = obj.get("cache_salt")
    salt = salt if isinstance(salt, str) else ""
    pck = obj.get("prompt_cache_key")
    if isinstance(pck, str) and pck:
        return key_of_name(salt, pck)
    if not text:
        return None
    return f"{salt}\x00{text}"


def key_of_name(salt: str, name: str) -> str:
    """A routing key for a `prompt_cache_key`: never a prompt's (a prompt key has no \x01 after
    the salt), and long enough to fill whole blocks of the router's index (block names are taken
    of whole blocks only), so the same name always matches its replica in full."""
    digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()
    return f"{salt}\x00\x01{digest * 8}"
