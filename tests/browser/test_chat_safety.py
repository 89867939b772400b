"""The chat page at `/` (server/static) kept safe and usable, in a real headless Chromium against
a real `kvserve serve` of the tiny Llama: the page and its assets are public while the API stays
guarded, model and user text never becomes markup, --api-key is asked for once, and the page
works at phone width and from the keyboard."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver

from tests.browser.conftest import API_KEY
from tests.browser.page import ChatPage, api_answer
from tests.support.api import http
from tests.support.server_process import ServerProcess

STATIC = Path(__file__).resolve().parents[2] / "server" / "static"
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


def xss_flag(driver: WebDriver) -> Any:
    """window.__xss after a pause that lets any onerror/onload handler fire."""
    time.sleep(0.3)
    return driver.execute_script("return window.__xss ?? null")


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
    scripts = ("app.js", "dom.js", "storage.js", "api.js", "transport.js", "generation.js",
               "markdown.js", "view.js", "metrics.js")
    for name, content_type in (*((s, "javascript") for s in scripts), ("style.css", "text/css"),
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


# ---- keys ------------------------------------------------------------------------------------

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
