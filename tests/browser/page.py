"""The chat page as the browser tests drive it: open it, fill the settings panel, type and send,
wait for answers, and read back what the page stored and shows. Elements are found by the ids
and data-testid attributes of server/static/index.html and app.js."""

from __future__ import annotations

import json
import re
from typing import Any

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.api import http, post_json
from tests.support.metrics import wait_idle
from tests.support.server_process import ServerProcess

TIMEOUT_S = 30.0
POLL_S = 0.02


def api_answer(server: ServerProcess, messages: list[dict[str, str]], api_key: str | None = None,
               **params: Any) -> dict[str, Any]:
    """The API's whole (non-streamed) answer to a chat request: the oracle for the page."""
    body = {"messages": messages, **params}
    if api_key is None:
        return dict(post_json(server, "/v1/chat/completions", body))
    reply = http(server, "POST", "/v1/chat/completions", body,
                 {"Authorization": f"Bearer {api_key}"})
    assert reply.status == 200, reply.raw
    return dict(reply.json())


def letters_and_digits(text: str) -> str:
    """Only the ASCII letters and digits of `text`: what Markdown rendering never removes, so
    the rendered answer and its source agree on them."""
    return re.sub(r"[^A-Za-z0-9]", "", text)


class ChatPage:
    """One browser tab on a server's chat page."""

    def __init__(self, driver: WebDriver, server: ServerProcess) -> None:
        self.driver = driver
        self.server = server

    # ---- navigation ------------------------------------------------------------------------

    def open(self, clear: bool = False, wait_ready: bool = True) -> None:
        """Loads the page (after emptying localStorage when `clear`)."""
        self.driver.get(self.server.url + "/")
        if clear:
            self.driver.execute_script("localStorage.clear()")
            self.driver.get(self.server.url + "/")
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Waits until the model list has loaded."""
        self.wait(lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))

    def wait(self, condition: Any, timeout: float = TIMEOUT_S, poll: float = POLL_S) -> Any:
        """Polls `condition(driver)` until it is truthy; streaming re-renders an answer's
        children every frame, so an element gone stale just means "look again"."""
        return WebDriverWait(self.driver, timeout, poll_frequency=poll,
                             ignored_exceptions=(StaleElementReferenceException,)
                             ).until(condition)

    def by_id(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def testid(self, name: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, f'[data-testid="{name}"]')

    # ---- settings --------------------------------------------------------------------------

    def configure(self, *, system_prompt: str | None = None, temperature: float | None = None,
                  top_p: float | None = None, max_tokens: int | None = None,
                  transport: str | None = None, model: str | None = None) -> dict[str, Any]:
        """Fills the settings panel as a user would (open, type, close); returns the page's
        settings, which must show each value given."""
        if model is not None:
            Select(self.by_id("model")).select_by_value(model)
        self.by_id("toggle-settings").click()
        self.wait(lambda d: self.by_id("settings").is_displayed())
        fields = {"system-prompt": system_prompt, "temperature": temperature, "top-p": top_p,
                  "max-tokens": max_tokens}
        for element_id, value in fields.items():
            if value is None:
                continue
            field = self.by_id(element_id)
            field.clear()
            field.send_keys(str(value))
        if transport is not None:
            Select(self.by_id("transport")).select_by_value(transport)
        self.by_id("close-settings").click()
        settings = dict(self.driver.execute_script("return {...kvchat.state.settings}"))
        expected = {"systemPrompt": system_prompt, "temperature": temperature, "topP": top_p,
                    "maxTokens": max_tokens, "transport": transport, "model": model}
        for key, value in expected.items():
            if value is not None:
                assert settings[key] == value, (key, settings)
        return settings

    # ---- chatting --------------------------------------------------------------------------

    def type_message(self, text: str) -> None:
        """Types `text` into the message box; each newline is typed as Shift+Enter."""
        box = self.by_id("prompt")
        lines = text.split("\n")
        keys: list[str] = [lines[0]]
        for line in lines[1:]:
            keys += [Keys.SHIFT, Keys.ENTER, Keys.NULL, line]
        box.send_keys(*keys)

    def send(self, text: str) -> None:
        """Types `text` and presses Enter."""
        self.type_message(text)
        self.by_id("prompt").send_keys(Keys.ENTER)

    def answers(self) -> list[WebElement]:
        """The assistant messages on screen, oldest first."""
        return self.driver.find_elements(
            By.CSS_SELECTOR, '[data-testid="message"][data-role="assistant"]')

    def last_answer(self) -> WebElement:
        return self.answers()[-1]

    def wait_first_token(self, count: int, timeout: float = TIMEOUT_S) -> None:
        """Waits until `count` answers are on screen and the last one streams and shows text.
        The check runs inside the page every 2 ms, so the test acts right after the first
        tokens appear (the tiny model streams a long answer in about a second)."""
        self.driver.set_script_timeout(timeout)
        self.driver.execute_async_script("""
            const [count, done] = arguments;
            (function check() {
              const answers = document.querySelectorAll(
                '[data-testid="message"][data-role="assistant"]');
              const last = answers[answers.length - 1];
              if (answers.length === count && last.dataset.state === 'streaming'
                  && last.querySelector('[data-testid="message-content"]').textContent) {
                done(true);
              } else {
                setTimeout(check, 2);
              }
            })();""", count)

    def wait_answer(self, count: int, timeout: float = TIMEOUT_S) -> WebElement:
        """Waits until `count` answers are on screen and the last one has finished (done,
        stopped or error); returns it."""
        def finished(_: WebDriver) -> WebElement | bool:
            answers = self.answers()
            if len(answers) != count:
                return False
            last = answers[-1]
            return last if last.get_attribute("data-state") != "streaming" else False

        return self.wait(finished, timeout, poll=0.05)

    def shown_text(self, message: WebElement) -> str:
        """The rendered text of a message's content (DOM text, as a screen reader gets it)."""
        return str(self.driver.execute_script(  # one call: the content is replaced per frame
            "return arguments[0].querySelector('[data-testid=message-content]').textContent",
            message))

    def stat(self, message: WebElement, name: str) -> str:
        """One figure under an answer (its value text), e.g. stat(m, "completion-tokens")."""
        return str(message.find_element(
            By.CSS_SELECTOR, f'[data-testid="stat-{name}"] .stat-value').text)

    def stored_conversations(self) -> list[dict[str, Any]]:
        """The conversations as the page saved them in localStorage."""
        raw = self.driver.execute_script(
            "return localStorage.getItem('kvserve.conversations')")
        return list(json.loads(raw)) if raw else []

    def stored_messages(self) -> list[dict[str, Any]]:
        """The current conversation's messages as stored in localStorage."""
        current = self.driver.execute_script("return localStorage.getItem('kvserve.current')")
        (conv,) = [c for c in self.stored_conversations() if c["id"] == current]
        return list(conv["messages"])

    def running_on_server(self) -> float:
        """num_requests_running as the page's metrics panel shows it."""
        text = self.testid("metric-running").text
        return float(text) if text not in ("", "–") else -1.0

    def stop_all(self) -> None:
        """Stops whatever the page still streams and waits for the server to be idle."""
        self.driver.execute_script(
            "for (const g of kvchat.state.generations.values()) g.stop()")
        wait_idle(self.server.url)

    def console_errors(self) -> list[str]:
        """SEVERE browser console entries since the last call (failed loads, exceptions)."""
        return [entry["message"] for entry in self.driver.get_log("browser")
                if entry["level"] == "SEVERE"]
