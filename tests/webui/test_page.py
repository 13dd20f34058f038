"""The page at `/` in headless Chromium against a real server on the default model.

A chat of two turns: each answer streams into the page, equals what the API answers for the
same conversation, and reports its reuse; the second turn reuses the first's prompt, and the
cache view says so with the server's own figures. Stop ends a generation and frees the slot.
Behind `--api-key` the page asks for the key. A screenshot of each state goes to
test-output/webui/ (checked non-blank; the expected text is checked through the DOM), and the
browser console stays free of errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageStat

from tests.http.harness import ServerProcess, free_port, running_server

pytestmark = pytest.mark.model

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_MS = 120_000  # a 2-core machine running the model and Chromium
# the page's defaults, given by the server (--ui-config, llama.cpp's web UI keys)
UI_SETTINGS = {"systemMessage": "You are a terse geography tutor.", "temperature": 0,
               "max_tokens": 24, "unknownKey": "ignored"}


@pytest.fixture(scope="module")
def server(output_dir: Path) -> Iterator[ServerProcess]:
    args = ["-c", "2048", "-np", "2", "--deterministic", "on", "--api-key", KEY,
            "--ui-config", json.dumps(UI_SETTINGS)]
    # LLAMA_SERVER_SLOTS_DEBUG=1: the cache view's text (the tree's first words), hidden by
    # default as llama-server's /slots hides prompts
    with running_server(args, str(output_dir / "server.log"),
                        env={"LLAMA_SERVER_SLOTS_DEBUG": "1"}) as srv:
        yield srv


class Console:
    """The console errors and uncaught exceptions of a page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


@contextmanager
def page_at(browser: Any, url: str, key_known: bool) -> Iterator[tuple[Any, Console]]:
    """A fresh browser profile on the page at `url`; `key_known`: the API key is in its
    localStorage already (as after an earlier visit), so no request is refused. No console
    error at the end (clear the ones a test expects)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    if key_known:
        context.add_init_script(f"localStorage.setItem('radixserve.apiKey', '{KEY}')")
    page = context.new_page()
    console = Console(page)
    try:
        page.goto(url + "/")
        yield page, console
        assert console.errors == []
    finally:
        context.close()


def shot(page: Any, path: Path) -> None:
    """A full-page screenshot that is not blank: many distinct colours, real contrast."""
    page.screenshot(path=str(path), full_page=True)
    img = Image.open(path).convert("L")
    assert img.size[0] >= 600 and img.size[1] >= 400, img.size
    lo, hi = img.getextrema()
    assert hi - lo > 100 and ImageStat.Stat(img).stddev[0] > 10, f"{path} looks blank"
    assert len(img.getcolors(1 << 16) or []) > 20, f"{path} has too few shades"


def api(srv: ServerProcess, method: str, path: str, body: Any = None) -> Any:
    r = httpx.request(method, srv.url + path, json=body, headers=AUTH, timeout=120)
    r.raise_for_status()
    return r.json()


def n_prompt_tokens(srv: ServerProcess, messages: list[dict[str, str]]) -> int:
    prompt = api(srv, "POST", "/apply-template", {"messages": messages})["prompt"]
    return len(api(srv, "POST", "/tokenize", {"content": prompt, "add_special": True})["tokens"])


def send(page: Any, text: str, n_done: int) -> Any:
    """Type `text`, send it, wait for the answer (the `n_done`-th finished one)."""
    page.fill("#prompt", text)
    page.click("#send")
    answer = page.locator("#messages li.msg.assistant").nth(n_done - 1)
    answer.locator(".figures").wait_for(timeout=TIMEOUT_MS)
    assert "done" in answer.get_attribute("class").split()
    return answer


def figures(answer: Any) -> dict[str, float]:
    f = answer.locator(".figures")
    return {k: float(f.get_attribute(f"data-{k}")) for k in ("prompt-n", "cache-n", "ttft-ms",
                                                              "tps")}


def settings(page: Any, **values: Any) -> None:
    if page.locator("#settings").get_attribute("open") is None:
        page.locator("#settings summary").click()  # open the settings, as a user would
    for k, v in values.items():
        page.fill(f"#{k}", str(v))


def test_a_two_turn_chat_streams_reuses_and_shows_it(browser: Any, server: ServerProcess,
                                                      output_dir: Path) -> None:
    with page_at(browser, server.url, key_known=True) as (page, _):
        chat_two_turns_then_a_new_chat(page, server, output_dir)


def chat_two_turns_then_a_new_chat(page: Any, server: ServerProcess, output_dir: Path) -> None:
    page.locator("#slots tr[data-slot]").nth(1).wait_for(timeout=TIMEOUT_MS)
    assert page.locator("#slots tr[data-slot]").count() == 2  # -np 2
    # the server's --ui-config are the page's defaults
    page.wait_for_function("v => document.querySelector('#system').value == v",
                           arg=UI_SETTINGS["systemMessage"], timeout=TIMEOUT_MS)
    assert page.input_value("#temperature") == "0" and page.input_value("#max_tokens") == "24"
    assert page.input_value("#top_k") == "40"  # the page's own default

    questions = ["What is the capital of France?", "And the capital of Italy?"]
    shown, answers = [], []
    for i, text in enumerate(questions, start=1):
        answer = send(page, text, i)
        shown.append(answer.locator(".content").inner_text())
        answers.append(figures(answer))
        shot(page, output_dir / f"chat-turn-{i}.png")
    first_prompt = answers[0]["prompt-n"] + answers[0]["cache-n"]
    assert answers[0]["cache-n"] == 0
    assert answers[1]["cache-n"] >= first_prompt  # the whole first turn was reused
    # the `reuse` report beside the timings names the tier that served it: the slot's own KV
    second = page.locator("#messages .figures").last
    assert second.get_attribute("data-tier") == "slot" and "reused from slot" in second.inner_text()
    assert all(f["ttft-ms"] > 0 and f["tps"] > 0 for f in answers)

    # only the page has used the server so far: the cache view's figures, once a poll saw the
    # server idle, are exactly the page's two answers, and each slot shows what it holds
    view = api(server, "GET", "/cache")
    assert [s["state"] for s in view["slots"]] == ["idle", "idle"]
    assert view["totals"] == {"requests": 2, "prompt_tokens": sum(f["prompt-n"] for f in answers),
                              "cached_tokens": sum(f["cache-n"] for f in answers)}
    page.wait_for_function(
        "v => document.querySelector('#totals').dataset.cachedTokens == v && [...document"
        ".querySelectorAll('#slots tr[data-slot]')].every(r => r.textContent.includes('idle'))",
        arg=str(view["totals"]["cached_tokens"]), timeout=10_000)
    totals = page.locator("#totals")
    assert int(totals.get_attribute("data-prompt-tokens")) == view["totals"]["prompt_tokens"]
    assert f"{view['totals']['cached_tokens']:,}" in totals.inner_text()
    for s in view["slots"]:
        row = page.locator(f"#slots tr[data-slot='{s['id']}']").inner_text()
        assert f"{s['n_tokens']:,} / {s['n_ctx']:,}" in row, (s, row)
    assert max(s["n_tokens"] for s in view["slots"]) > first_prompt
    # the chart: one bar per prompt, the last one the second answer's reuse
    bars = page.locator("#history-chart g:has(> title)")
    assert bars.count() == 2
    last_bar = bars.nth(1).locator("title").text_content()
    assert f"{int(answers[1]['cache-n']):,} reused" in last_bar
    assert "reused" in page.locator("#history-chart").get_attribute("aria-label").lower()
    shot(page, output_dir / "cache-view.png")

    # what the page showed is the API's answer to the same conversation, token for token, and
    # its figures add up to the whole prompt as the server tokenizes it
    history = [{"role": "system", "content": UI_SETTINGS["systemMessage"]}]
    for text, answer, f in zip(questions, shown, answers):
        history.append({"role": "user", "content": text})
        want = api(server, "POST", "/v1/chat/completions", {
            "messages": history, "temperature": 0, "max_tokens": 24})
        assert answer == want["choices"][0]["message"]["content"] and answer.strip()
        assert f["prompt-n"] + f["cache-n"] == n_prompt_tokens(server, history)
        history.append({"role": "assistant", "content": answer})

    # a new chat with another system prompt takes the other slot; the idle one's KV goes to the
    # radix tree (idle-slot caching), and the tree drawing shows it with its first words
    page.click("#new-chat")
    assert page.locator("#messages li").count() == 0
    settings(page, system="")
    send(page, "Name a large river.", 1)
    page.wait_for_function("() => document.querySelector('#tree').textContent.includes("
                           "'You are a terse') && document.querySelectorAll('#lru li').length",
                           timeout=10_000)
    (root,) = api(server, "GET", "/cache")["tree"]["roots"]
    assert root["leaves"] >= 1 and root["subtree_tokens"] >= answers[1]["cache-n"]
    shot(page, output_dir / "cache-tree.png")


def test_stop_ends_the_generation_and_frees_the_slot(browser: Any, server: ServerProcess,
                                                     output_dir: Path) -> None:
    with page_at(browser, server.url, key_known=True) as (page, _):
        stop_a_long_answer(page, server, output_dir)


def stop_a_long_answer(page: Any, server: ServerProcess, output_dir: Path) -> None:
    settings(page, max_tokens=-1, temperature=0.8, seed=7)  # seeded: a long answer, every run
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    answer = page.locator("#messages li.msg.assistant").last
    page.wait_for_function(
        "() => (document.querySelector('#messages li.msg.assistant:last-child .content')"
        "?.textContent ?? '').length > 40", timeout=TIMEOUT_MS)
    assert page.locator("#send").is_disabled() and page.locator("#stop").is_enabled()
    page.click("#stop")
    page.wait_for_function(
        "() => document.querySelector('#messages li.msg.assistant:last-child')"
        ".classList.contains('stopped')", timeout=10_000)
    assert answer.locator(".content").inner_text().strip()  # the partial answer stays
    # the server saw the client go and stopped the task: no slot keeps generating
    for _ in range(100):
        if not any(s["is_processing"] for s in api(server, "GET", "/slots")):
            break
        page.wait_for_timeout(100)
    assert not any(s["is_processing"] for s in api(server, "GET", "/slots"))
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    shot(page, output_dir / "stopped.png")


def test_behind_an_api_key_the_page_asks_for_it(browser: Any, server: ServerProcess,
                                               output_dir: Path) -> None:
    with page_at(browser, server.url, key_known=False) as (page, console):
        give_the_key_when_asked(page, console, output_dir)


def give_the_key_when_asked(page: Any, console: Console, output_dir: Path) -> None:
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible", timeout=TIMEOUT_MS)
    shot(page, output_dir / "api-key-asked.png")
    # the only errors so far: the browser reporting the refused requests
    assert console.errors and all("401" in e for e in console.errors), console.errors
    console.errors.clear()
    page.fill("#key-input", KEY)
    page.click("#key-save")
    dialog.wait_for(state="hidden", timeout=10_000)
    page.locator("#slots tr[data-slot]").nth(1).wait_for(timeout=TIMEOUT_MS)
    settings(page, temperature=0, max_tokens=8)
    answer = send(page, "Say hello.", 1)
    assert answer.locator(".content").inner_text().strip()
    assert page.evaluate("localStorage.getItem('radixserve.apiKey')") == KEY
    shot(page, output_dir / "api-key-accepted.png")


def test_opened_while_the_model_loads_the_page_waits_for_it(browser: Any,
                                                           output_dir: Path) -> None:
    """The page is served before the model is ready (as llama-server's); it asks again until
    the API answers, then shows the model and takes the server's defaults."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "-c", "1024", "-n", "77", "--temp", "0.3",
           "--ui-config", json.dumps({"systemMessage": "Configured."})]
    with open(output_dir / "loading-server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # the page is up while the API still answers 503
        while True:
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the page was not served within 120 s"
            try:
                if httpx.get(url + "/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        with page_at(browser, url, key_known=False) as (page, console):
            page.wait_for_function(
                "() => document.querySelector('#system').value == 'Configured.'",
                timeout=TIMEOUT_MS)
            assert page.inner_text("#model") == api_props(url)["model_alias"]
            assert page.input_value("#temperature") == "0.3"  # --temp: the server's default
            assert page.input_value("#max_tokens") == "77"  # -n
            page.locator("#slots tr[data-slot]").first.wait_for(timeout=TIMEOUT_MS)
            # it did open during the load: the browser reported the 503s, and nothing else
            assert console.errors and all("503" in e for e in console.errors), console.errors
            console.errors.clear()
            shot(page, output_dir / "after-loading.png")
    finally:
        proc.terminate()
        proc.wait(30)


def api_props(url: str) -> dict[str, Any]:
    return httpx.get(url + "/props", timeout=60).json()
