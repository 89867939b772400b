"""The built-in chat page at `/` (server/static), driven in a real headless Chromium against a
real `kvserve serve` of the tiny Llama: streamed answers equal the API's greedy answers, Stop
cancels on the server, turns accumulate, errors show the server's message, model text never
becomes markup, SSE takes over when the socket fails, and --api-key is asked for once."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select

from loadtest.serve_process import free_port
from tests.browser.conftest import API_KEY, MAX_MODEL_LEN, SERVED_NAMES
from tests.browser.page import ChatPage, api_answer, letters_and_digits
from tests.support.api import http
from tests.support.metrics import scrape, wait_idle
from tests.support.server_process import ServerProcess

STATIC = Path(__file__).resolve().parents[2] / "server" / "static"
SYSTEM = "You answer briefly."
# A long answer to stop midway: the first of these prompts whose greedy answer runs all
# LONG_MAX_TOKENS without an EOS (about a second of streaming from the tiny Llama). Picked at
# run time, so a change to the chat template or the numerics picks another one.
LONG_CANDIDATES = ("Count to one thousand", "Stop here", "Hello there", "Keep talking", "Hi",
                   "Go on", "Write a long letter", "Tell me everything", "Please continue")
LONG_MAX_TOKENS = 960
# Strings that would run code if they ever reached the DOM as markup; each sets window.__xss.
HOSTILE = [
    "<script>window.__xss = 'script'</script>",
    "<img src=x onerror=\"window.__xss = 'img'\">",
    "```html\n<img src=x onerror=\"window.__xss = 'code'\">\n```",
    "**<svg onload=\"window.__xss = 'svg'\"></svg>** and _<b onmouseover=\"x()\">b</b>_",
    "[click me](javascript:window.__xss='link') and [ok](https://example.org/a?b=<c>)",
    "`<iframe srcdoc=\"<script>parent.__xss = 'iframe'</script>\"></iframe>`",
    "> <details open ontoggle=\"window.__xss = 'details'\">\n- <a href=x>a</a>",
    "<img src=x onerror=\"window.__xss = 'before'\"> before `code`, <svg/onload=x()> after",
]
MARKUP_TAGS = "script, img, svg, iframe, details, b, object, embed, [onerror], [onload]"


def chat_answer(server: ServerProcess, messages: list[dict[str, str]], **params: Any) -> str:
    """The API's greedy answer text (temperature 0, top_p 1, as the page sends them)."""
    body = api_answer(server, messages, temperature=0, top_p=1, **params)
    return str(body["choices"][0]["message"]["content"])


def aborted(server: ServerProcess) -> float:
    """Requests the server has finished as aborted so far."""
    return scrape(server.url).value("request_success_total", finished_reason="abort")


def xss_flag(driver: WebDriver) -> Any:
    """window.__xss after a pause that lets any onerror/onload handler fire."""
    time.sleep(0.3)
    return driver.execute_script("return window.__xss ?? null")


@pytest.fixture(scope="module")
def long_prompt(chat_server: ServerProcess) -> tuple[str, str]:
    """A prompt from LONG_CANDIDATES and its whole greedy answer, which reaches max tokens (a
    stopped answer must be a strict prefix of it)."""
    for prompt in LONG_CANDIDATES:
        body = api_answer(chat_server, [{"role": "user", "content": prompt}], temperature=0,
                          top_p=1, max_tokens=LONG_MAX_TOKENS)
        if body["choices"][0]["finish_reason"] == "length":
            return prompt, str(body["choices"][0]["message"]["content"])
    raise AssertionError(f"no greedy answer to {LONG_CANDIDATES} runs {LONG_MAX_TOKENS} tokens")


# ---- serving ---------------------------------------------------------------------------------

def test_page_and_assets_are_public_while_the_api_stays_guarded(keyed_server: ServerProcess
                                                                 ) -> None:
    index = http(keyed_server, "GET", "/")
    assert index.status == 200
    assert index.headers["Content-Type"].startswith("text/html")
    assert index.raw == (STATIC / "index.html").read_bytes()
    # Nothing from a CDN: every src and href is this server's /static or an inline data: URL.
    html = index.raw.decode()
    for url in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert url.startswith(("/static/", "data:")), url
    for name, content_type in (("app.js", "javascript"), ("style.css", "text/css"),
                               ("index.html", "text/html")):
        reply = http(keyed_server, "GET", f"/static/{name}")
        assert reply.status == 200, name
        assert content_type in reply.headers["Content-Type"], reply.headers["Content-Type"]
        assert reply.raw == (STATIC / name).read_bytes()
    for path in ("/static/", "/static", "/static/missing.js", "/static/../app.py",
                 "/static/%2e%2e/app.py", "/static/..%2fapp.py"):
        reply = http(keyed_server, "GET", path)
        assert reply.status in (403, 404), (path, reply.status)
        assert b"Index of" not in reply.raw and b"def create_app" not in reply.raw, path
    assert http(keyed_server, "GET", "/v1/models").status == 401
    ok = http(keyed_server, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status == 200


# ---- chatting --------------------------------------------------------------------------------

def test_streamed_answer_equals_the_api_greedy_answer(page: ChatPage,
                                                      chat_server: ServerProcess) -> None:
    options = [o.get_attribute("value") for o in Select(page.by_id("model")).options]
    assert options == list(SERVED_NAMES)  # the picker lists /v1/models
    page.configure(system_prompt=SYSTEM, temperature=0, max_tokens=24, model=SERVED_NAMES[1])
    page.send("Hello there")
    answer = page.wait_answer(1)
    assert answer.get_attribute("data-state") == "done"

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    expected = api_answer(chat_server, messages, model=SERVED_NAMES[1], temperature=0, top_p=1,
                          max_tokens=24)
    text = expected["choices"][0]["message"]["content"]
    stored = page.stored_messages()
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[0]["content"] == "Hello there"
    assert stored[1]["content"] == text  # the streamed deltas, joined, kept in localStorage
    assert letters_and_digits(page.shown_text(answer)) == letters_and_digits(text)

    # Live figures: TTFT, decode rate, and the token counts from the usage chunk.
    usage = expected["usage"]
    assert page.stat(answer, "prompt-tokens") == str(usage["prompt_tokens"])
    assert page.stat(answer, "completion-tokens") == str(usage["completion_tokens"])
    assert re.fullmatch(r"\d+ ms", page.stat(answer, "ttft")), page.stat(answer, "ttft")
    if usage["completion_tokens"] > 1:
        assert float(page.stat(answer, "tps")) > 0
    assert page.stat(answer, "transport") == "WebSocket"
    assert page.stat(answer, "model") == SERVED_NAMES[1]  # the picker's choice was sent
    assert page.console_errors() == []


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_stop_cancels_the_request_on_the_server(page: ChatPage, chat_server: ServerProcess,
                                                long_prompt: tuple[str, str],
                                                transport: str) -> None:
    prompt, long_answer = long_prompt
    page.configure(temperature=0, max_tokens=LONG_MAX_TOKENS, transport=transport)
    aborts = aborted(chat_server)
    page.send(prompt)
    page.wait_first_token(1)  # tokens appear before the answer ends
    assert scrape(chat_server.url)["running"] == 1
    page.by_id("stop").click()
    answer = page.wait_answer(1)
    assert answer.get_attribute("data-state") == "stopped"
    assert answer.get_attribute("data-transport") == transport

    # The server aborts the request: nothing runs, every KV block is free again.
    wait_idle(chat_server.url)
    assert aborted(chat_server) == aborts + 1
    page.wait(lambda _: page.running_on_server() == 0, timeout=10)
    assert page.testid("metric-waiting").text == "0"
    assert page.testid("metric-kv").text == "0.0%"
    figures = scrape(chat_server.url)
    rate = 100 * figures["prefix_cache_hits"] / figures["prefix_cache_queries"]
    page.wait(lambda _: page.testid("metric-prefix").text == f"{rate:.1f}%", timeout=10)

    # What the page kept is a strict prefix of the whole greedy answer.
    stopped = page.stored_messages()[-1]
    assert stopped["state"] == "stopped"
    assert 0 < len(stopped["content"]) < len(long_answer)
    assert long_answer.startswith(stopped["content"])
    if transport == "websocket":  # the socket's done message carries the usage
        assert 0 < int(page.stat(answer, "completion-tokens")) < LONG_MAX_TOKENS
    assert page.by_id("send").is_displayed() and not page.by_id("stop").is_displayed()


def test_second_turn_includes_the_first(page: ChatPage, chat_server: ServerProcess) -> None:
    page.configure(temperature=0, max_tokens=16)
    page.send("Hello there")
    page.wait_answer(1)
    second = "Tell me more\nabout the river"  # typed with Shift+Enter between the lines
    page.send(second)
    answer = page.wait_answer(2)
    assert answer.get_attribute("data-state") == "done"

    first = [{"role": "user", "content": "Hello there"}]
    first_answer = chat_answer(chat_server, first, max_tokens=16)
    both = [*first, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": second}]
    expected = chat_answer(chat_server, both, max_tokens=16)
    alone = chat_answer(chat_server, [{"role": "user", "content": second}], max_tokens=16)
    assert expected != alone  # so equality below shows the first turn was sent
    stored = page.stored_messages()
    assert [(m["role"], m["content"]) for m in stored] == [
        ("user", "Hello there"), ("assistant", first_answer), ("user", second),
        ("assistant", expected)]
    user_bubbles = page.driver.find_elements(
        By.CSS_SELECTOR, '[data-testid="message"][data-role="user"]')
    assert page.shown_text(user_bubbles[1]) == second


def test_regenerate_and_two_conversations_share_the_socket(page: ChatPage,
                                                          chat_server: ServerProcess,
                                                          long_prompt: tuple[str, str]) -> None:
    prompt = long_prompt[0]
    page.configure(temperature=0, max_tokens=LONG_MAX_TOKENS)
    aborts = aborted(chat_server)
    page.send(prompt)
    page.wait_first_token(1)
    page.testid("regenerate").click()  # mid-answer: the old id is cancelled, a new one starts
    page.wait(lambda _: aborted(chat_server) == aborts + 1, timeout=10)
    page.wait_first_token(1)
    # While it streams, a second conversation: the message is typed first (Enter would not send
    # it here, one answer at a time per conversation), then New chat and Enter start it.
    page.type_message(prompt)
    page.testid("new-chat").click()
    page.by_id("prompt").send_keys(Keys.ENTER)
    page.wait_first_token(1)
    assert scrape(chat_server.url)["running"] == 2  # both answers stream at once
    assert page.driver.execute_script("return kvchat.state.generations.size") == 2
    page.by_id("stop").click()  # stops the second conversation only
    assert page.wait_answer(1).get_attribute("data-state") == "stopped"
    # Back to the first conversation (listed second: the newest comes first); stop it too.
    page.driver.find_elements(By.CSS_SELECTOR, '[data-testid="conversation"]')[1].click()
    if page.driver.execute_script("return kvchat.state.generations.size"):
        page.by_id("stop").click()
    assert page.wait_answer(1).get_attribute("data-state") in ("stopped", "done")
    wait_idle(chat_server.url)
    assert aborted(chat_server) >= aborts + 2  # the replaced answer and the second one
    # The three requests of this test went over the one socket the page opened.
    socket = page.driver.execute_script(
        "return {opened: kvchat.socket.opened, sent: kvchat.socket.nextId - 1}")
    assert socket == {"opened": 1, "sent": 3}

    # Regenerate a finished answer with a short max tokens: the same greedy answer as the API.
    page.configure(max_tokens=8)
    page.testid("regenerate").click()
    answer = page.wait_answer(1)
    assert answer.get_attribute("data-state") == "done"
    expected = chat_answer(chat_server, [{"role": "user", "content": prompt}], max_tokens=8)
    assert page.stored_messages()[-1]["content"] == expected


def test_an_error_shows_the_server_message(page: ChatPage, chat_server: ServerProcess) -> None:
    page.configure(max_tokens=16)
    too_long = " ".join(["The cat sees the dog near the river."] * 150)
    tokens = http(chat_server, "POST", "/tokenize", {"prompt": too_long}).json()["count"]
    assert tokens > MAX_MODEL_LEN
    # Typing 5000 characters key by key is slow: paste it, then press Enter as a user would.
    page.driver.execute_script("document.getElementById('prompt').value = arguments[0]",
                               too_long)
    page.by_id("prompt").send_keys(Keys.ENTER)
    answer = page.wait_answer(1)
    assert answer.get_attribute("data-state") == "error"

    settings = page.driver.execute_script("return {...kvchat.state.settings}")
    reply = http(chat_server, "POST", "/v1/chat/completions", {
        "model": SERVED_NAMES[0], "messages": [{"role": "user", "content": too_long}],
        "stream": True, "stream_options": {"include_usage": True},
        "temperature": settings["temperature"], "top_p": 1, "max_tokens": 16})
    assert reply.status == 400
    message = reply.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message
    shown = answer.find_element(By.CSS_SELECTOR, '[data-testid="message-error"]')
    assert shown.text == message

    # The conversation goes on without the failed turn: the next answer is the API's greedy
    # answer to the new message alone.
    page.configure(temperature=0)
    page.send("Hello there")
    assert page.wait_answer(2).get_attribute("data-state") == "done"
    expected = chat_answer(chat_server, [{"role": "user", "content": "Hello there"}],
                           max_tokens=16)
    assert page.stored_messages()[-1]["content"] == expected


# ---- safety ----------------------------------------------------------------------------------

def test_the_renderer_keeps_hostile_text_as_text(page: ChatPage) -> None:
    results = page.driver.execute_script("""
        const out = [];
        for (const source of arguments[0]) {
          const box = document.createElement('div');
          box.className = 'probe';
          box.append(kvchat.renderMarkdown(source));
          document.body.append(box);
          out.push({text: box.textContent,
                    markup: box.querySelectorAll(arguments[1]).length,
                    hrefs: [...box.querySelectorAll('a')].map(a => a.getAttribute('href'))});
        }
        return out;""", HOSTILE, MARKUP_TAGS)
    assert xss_flag(page.driver) is None
    by_source = dict(zip(HOSTILE, results, strict=True))
    for source, result in by_source.items():
        assert result["markup"] == 0, (source, result)
    assert by_source[HOSTILE[0]]["text"] == HOSTILE[0]
    assert by_source[HOSTILE[1]]["text"] == HOSTILE[1]
    assert "<img src=x onerror=\"window.__xss = 'code'\">" in by_source[HOSTILE[2]]["text"]
    assert "<svg onload=\"window.__xss = 'svg'\"></svg>" in by_source[HOSTILE[3]]["text"]
    link = by_source[HOSTILE[4]]
    assert "[click me](javascript:window.__xss='link')" in link["text"]  # no link, just text
    assert link["hrefs"] == ["https://example.org/a?b=%3Cc%3E"]
    assert "<iframe srcdoc=" in by_source[HOSTILE[5]]["text"]
    assert "<details open ontoggle=" in by_source[HOSTILE[6]]["text"]
    assert by_source[HOSTILE[7]]["text"] == HOSTILE[7].replace("`", "")
    # ... and it is on screen as the literal characters.
    visible = page.driver.find_elements(By.CSS_SELECTOR, ".probe")[1].text
    assert visible == HOSTILE[1]


def test_stored_and_typed_hostile_text_is_shown_as_text(page: ChatPage) -> None:
    hostile_answer = "\n\n".join(HOSTILE)
    conversation = {
        "id": "hostile", "title": "<img src=x onerror=\"window.__xss = 'title'\">", "updated": 1,
        "messages": [
            {"role": "user", "content": "<script>window.__xss = 'user'</script>"},
            {"role": "assistant", "content": hostile_answer, "state": "done",
             "model": "<img src=x onerror=\"window.__xss = 'model'\">",
             "error": "<img src=x onerror=\"window.__xss = 'error'\">",
             "stats": {"promptTokens": "<img src=x onerror=\"window.__xss = 'stat'\">"}},
        ]}
    page.driver.execute_script(
        "localStorage.setItem('kvserve.conversations', JSON.stringify([arguments[0]]));"
        "localStorage.setItem('kvserve.current', 'hostile');", conversation)
    page.open()
    answer = page.wait_answer(1)
    assert xss_flag(page.driver) is None
    markup = page.driver.execute_script(
        "return document.querySelectorAll(arguments[0]).length - 1", MARKUP_TAGS)  # app.js
    assert markup == 0
    shown = page.shown_text(answer)
    assert HOSTILE[0] in shown and HOSTILE[1] in shown
    assert answer.find_element(By.CSS_SELECTOR, '[data-testid="message-error"]').text == \
        conversation["messages"][1]["error"]
    assert page.stat(answer, "prompt-tokens") == conversation["messages"][1]["stats"][
        "promptTokens"]
    assert page.testid("conversation").text == conversation["title"]
    user = page.driver.find_element(By.CSS_SELECTOR, '[data-testid="message"][data-role="user"]')
    assert page.shown_text(user) == "<script>window.__xss = 'user'</script>"

    # A user's own hostile message, typed and sent, stays text too.
    page.testid("new-chat").click()
    page.configure(max_tokens=4)
    typed = "<img src=x onerror=\"window.__xss = 'typed'\"> **bold?**"
    page.send(typed)
    page.wait_answer(1)
    user = page.driver.find_element(By.CSS_SELECTOR, '[data-testid="message"][data-role="user"]')
    assert user.text == typed
    assert xss_flag(page.driver) is None


# ---- transports and keys ---------------------------------------------------------------------

@pytest.mark.parametrize("failure", ["refused", "hangs"])
def test_sse_takes_over_when_the_socket_fails(page: ChatPage, chat_server: ServerProcess,
                                              failure: str) -> None:
    driver = page.driver
    # Every WebSocket the page opens goes to a broken endpoint; HTTP is untouched. (DevTools'
    # URL blocking does not apply to WebSockets, hence a script run before the page's own.)
    # "refused": the handshake gets a 404, as from a proxy without upgrades. "hangs": another
    # port, which the page's Content-Security-Policy blocks; Chromium then fires no event at
    # all, so the page's own open timeout has to give up on the socket.
    target = {"refused": "'$1/v1/no-websocket-here'",
              "hangs": f"'//127.0.0.1:{free_port()}/v1/ws'"}[failure]
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        "const RealWebSocket = window.WebSocket;"
        "window.WebSocket = class extends RealWebSocket {"
        "  constructor(url, protocols) {"
        f"    super(String(url).replace(/(\\/\\/[^/]+).*/, {target}), protocols);"
        "  }"
        "};")})
    try:
        page.open()
        page.configure(temperature=0, max_tokens=24)
        page.send("Hello there")
        answer = page.wait_answer(1)
        assert page.driver.execute_script("return kvchat.socket.opened") == 0
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument",
                               {"identifier": script["identifier"]})
    assert answer.get_attribute("data-state") == "done"
    assert page.stat(answer, "transport") == "SSE"
    assert page.testid("transport-status").text == "SSE (socket unavailable)"
    expected = chat_answer(chat_server, [{"role": "user", "content": "Hello there"}],
                           max_tokens=24)
    assert page.stored_messages()[-1]["content"] == expected
    assert page.stat(answer, "completion-tokens") != "–"  # usage arrived over SSE as well


def test_the_api_key_is_asked_for_once_and_kept(browser: WebDriver,
                                               keyed_server: ServerProcess) -> None:
    page = ChatPage(browser, keyed_server)
    page.open(clear=True, wait_ready=False)
    dialog = page.by_id("api-key-dialog")
    page.wait(lambda _: dialog.is_displayed())
    assert "API key" in page.by_id("api-key-message").text  # the server's 401 message
    page.by_id("api-key-input").send_keys("wrong-key", Keys.ENTER)
    # A wrong key gets a 401 again, which asks again.
    page.wait(lambda d: d.execute_script(
        "const dialog = document.getElementById('api-key-dialog');"
        "return dialog.open && document.getElementById('api-key-input').value === ''"))
    page.by_id("api-key-input").send_keys(API_KEY, Keys.ENTER)
    page.wait_ready()
    assert not dialog.is_displayed()

    page.configure(temperature=0, max_tokens=16)
    page.send("Hello there")
    answer = page.wait_answer(1)
    assert answer.get_attribute("data-state") == "done"
    assert page.stat(answer, "transport") == "WebSocket"  # the key went as ?api_key=
    expected = api_answer(keyed_server, [{"role": "user", "content": "Hello there"}],
                          api_key=API_KEY, temperature=0, top_p=1, max_tokens=16)
    assert page.stored_messages()[-1]["content"] == expected["choices"][0]["message"]["content"]

    page.open()  # kept in localStorage: no second question
    assert not page.by_id("api-key-dialog").is_displayed()
    assert len(page.answers()) == 1


# ---- layout and keyboard ---------------------------------------------------------------------

def test_phone_width_and_keyboard(page: ChatPage) -> None:
    driver = page.driver
    driver.set_window_size(390, 844)
    page.open()
    width = driver.execute_script("return window.innerWidth")
    assert width <= 420
    assert driver.execute_script("return document.documentElement.scrollWidth") <= width
    for element_id in ("prompt", "send", "model", "toggle-settings"):
        element = page.by_id(element_id)
        assert element.is_displayed(), element_id
        rect = element.rect
        assert rect["x"] >= 0 and rect["x"] + rect["width"] <= width, (element_id, rect)

    # Keyboard only: the message box has focus on load, Tab reaches Send and Shift+Tab comes
    # back, Enter sends.
    assert driver.switch_to.active_element.get_attribute("id") == "prompt"
    driver.switch_to.active_element.send_keys("Hi", Keys.TAB)
    assert driver.switch_to.active_element.get_attribute("id") == "send"
    driver.switch_to.active_element.send_keys(Keys.SHIFT, Keys.TAB, Keys.NULL, Keys.ENTER)
    assert page.wait_answer(1).get_attribute("data-state") == "done"
    bubble = driver.find_element(By.CSS_SELECTOR, '[data-testid="message"][data-role="user"]')
    assert bubble.text == "Hi"
    assert driver.execute_script("return document.documentElement.scrollWidth") <= width

    # The conversations and the metrics panel are an overlay behind the menu button.
    assert not page.by_id("sidebar").is_displayed()
    page.by_id("toggle-sidebar").click()
    assert page.testid("metrics-panel").is_displayed()
    assert page.testid("conversation").is_displayed()
    page.by_id("toggle-sidebar").click()
    assert not page.by_id("sidebar").is_displayed()
