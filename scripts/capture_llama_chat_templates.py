"""Capture llama.cpp's built-in chat templates (`--chat-template NAME`) as test fixtures.

    python scripts/capture_llama_chat_templates.py /path/to/llama-server model.gguf

For each name of llama-server's built-in list (its --help, under --chat-template) it starts
`llama-server -m model.gguf --no-jinja --chat-template NAME` (without --jinja, llama-server
renders a name through llama.cpp's llm_chat_apply_template; with --jinja, its default, it takes
the name as a Jinja text and renders it literally) and POSTs each conversation of CONVERSATIONS
to /apply-template, with and without add_generation_prompt. Any GGUF loads (the prompt does not
depend on the model); the tests write one with tests/tiny_gguf.py.

Writes tests/fixtures/llama-chat-templates.json: {"conversations": CONVERSATIONS,
"prompts": {name: [[prompt with add_generation_prompt, prompt without], one a conversation]}}. tests/test_builtin_templates.py renders the same conversations with
radixserve's Jinja texts (radixserve/text/builtin_templates.py) and compares.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests/fixtures/llama-chat-templates.json"

# whitespace around contents (several templates trim; C's isspace, not Unicode's), a system
# message first, none, and in the middle; tool, other and non-ASCII roles (upper-cased by
# some); no conversation ends with an assistant message (llama-server would continue it,
# --prefill-assistant)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": " You are a helpful assistant\n"},
     {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": " Hi there \n"},
     {"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "\tone "},
     {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three\n\n"},
     {"role": "assistant", "content": "four"},
     {"role": "system", "content": "be brief"},
     {"role": "user", "content": "five"}],
    [{"role": "system", "content": "S"},
     {"role": "user", "content": "call it"},
     {"role": "assistant", "content": "ok"},
     {"role": "tool", "content": "42", "tool_call_id": "c1"},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "\u00a0nbsp\u3000 \x0b"},
     {"role": "assistant_tool_call", "content": "{\"f\": 1}"},
     {"role": "function", "content": "r"},
     {"role": "\u00e9xtra", "content": " x "},
     {"role": "user", "content": "\f end\r"}],
]


def builtin_names(server: str) -> list[str]:
    out = subprocess.run([server, "--help"], capture_output=True, text=True, check=True).stdout
    block = out.split("list of built-in templates:", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if not line.startswith(" " * 40) or "(env:" in line:
            break
        lines.append(line.strip())
    return [n.strip() for n in " ".join(lines).split(",") if n.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def capture(server: str, model: str, name: str) -> list[list[str]]:
    port = free_port()
    proc = subprocess.Popen([server, "-m", model, "--port", str(port), "-c", "512", "-np", "1",
                             "--no-jinja", "--chat-template", name],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"llama-server did not start for {name}")
        return [[post(url + "/apply-template", {"messages": messages,
                                                "add_generation_prompt": agp})["prompt"]
                 for agp in (True, False)] for messages in CONVERSATIONS]
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    server, model = sys.argv[1], sys.argv[2]
    names = builtin_names(server)
    assert names and all(re.fullmatch(r"[a-z0-9_.-]+", n) for n in names), names
    prompts = {name: capture(server, model, name) for name in names}
    OUT.write_text(json.dumps({"conversations": CONVERSATIONS, "prompts": prompts}, indent=1,
                              ensure_ascii=False) + "\n")
    print(f"{len(prompts)} templates -> {OUT}")


if __name__ == "__main__":
    main()
