"""The chat page's browser tests: one `kvserve serve` of the tiny Llama (two served names, so
the model picker has a choice, and a small --max-model-len, so an over-long prompt errors), one
with --api-key, and one headless Chromium driven by selenium, all shared by the session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

from tests.browser.page import ChatPage
from tests.support.server_process import ServerProcess, kvserve

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MAX_MODEL_LEN = 1024  # the tiny Llama's max_position_embeddings: room for a long answer to stop
SERVED_NAMES = ("tiny-llama", "tiny-llama-b")
API_KEY = "browser-test-key"
WINDOW = (1280, 900)
# float32 whatever the CPU offers (`--dtype auto` picks bfloat16 where the CPU has it), so the
# tiny Llama's answers, and the long one the Stop tests need, are the same on every machine.
PINNED = ("--dtype", "float32")


@pytest.fixture(scope="session")
def chat_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """The tiny Llama served as two names with --max-model-len 1024."""
    with kvserve(tiny_llama_dir, *PINNED, "--max-model-len", str(MAX_MODEL_LEN),
                 "--served-model-name", *SERVED_NAMES,
                 log_dir=tmp_path_factory.mktemp("chat_server")) as server:
        yield server


@pytest.fixture(scope="session")
def keyed_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    """The tiny Llama behind --api-key."""
    with kvserve(tiny_llama_dir, *PINNED, "--max-model-len", str(MAX_MODEL_LEN),
                 "--api-key", API_KEY,
                 log_dir=tmp_path_factory.mktemp("keyed_server")) as server:
        yield server


@pytest.fixture(scope="session")
def browser() -> Iterator[WebDriver]:
    """Debian's chromium in headless mode (installed from apt by `make setup`)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make setup` installs chromium and "
                    "chromium-driver from apt")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--disable-extensions", f"--window-size={WINDOW[0]},"
                     f"{WINDOW[1]}"):
        options.add_argument(argument)
    # The browser console's errors and warnings, read back by ChatPage.console_errors().
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: WebDriver, chat_server: ServerProcess) -> Iterator[ChatPage]:
    """The chat page of `chat_server`, opened on empty localStorage at the default size."""
    browser.set_window_size(*WINDOW)
    browser.get_log("browser")  # drop what earlier tests left: each test reads its own errors
    chat = ChatPage(browser, chat_server)
    chat.open(clear=True)
    yield chat
    chat.stop_all()
