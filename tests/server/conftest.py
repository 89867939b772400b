"""The server tests' shared `kvserve serve` process (the default one is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.api import openai_client
from tests.support.server_process import MAX_BODY_BYTES, ServerProcess, kvserve


@pytest.fixture(scope="session")
def capped_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    """The tiny Llama with a 64 KiB body and WebSocket message cap, shared for the session by
    test_server_errors.py and test_server_ws.py; their tests compare metrics before and after
    instead of counting from zero."""
    with kvserve(tiny_llama_dir, "--max-body-bytes", str(MAX_BODY_BYTES),
                 log_dir=tmp_path_factory.mktemp("capped_server")) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official SDK pointed at the module's `server` fixture."""
    return openai_client(server)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    """The name the module's server serves its model under."""
    return client.models.list().data[0].id
