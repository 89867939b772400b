"""The `kvserve` command line: generate, plan, and clear errors with exit code 2."""

from __future__ import annotations

import errno
import logging
import re
import socket
from pathlib import Path

import pytest

from server.cli import main
from server.serve import bind_sockets


def test_generate_prints_text_and_a_summary(tiny_llama_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(tiny_llama_dir), "--raw", "--prompt", "the cat sees",
                 "--max-tokens", "5", "--kv-cache-memory-bytes", str(2**20)])
    out = capsys.readouterr()
    assert code == 0
    match = re.search(r"\[(\d+) tokens in [0-9.]+ s, finish_reason=(\w+)\]", out.err)
    assert match is not None
    num_tokens, reason = int(match.group(1)), match.group(2)
    assert (num_tokens == 5 and reason == "length") or (1 <= num_tokens <= 5 and
                                                          reason == "stop")


def test_plan_reports_the_formula_for_a_folder(tiny_llama_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tiny_llama_dir), "--memory", "1GiB", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    # tiny llama: 2 layers x 2 kv heads x head_dim 16 x 2 (K and V) x 4 bytes
    assert "512 B" in out.replace(",", "")
    assert "Recommended flags:" in out


def test_bad_model_path_is_a_clear_error(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", str(tmp_path / "missing"), "--max-tokens", "2"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_max_model_len_that_does_not_fit_names_the_flag(tiny_llama_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    code = main(["generate", str(tiny_llama_dir), "--max-model-len", "1024",
                 "--kv-cache-memory-bytes", "65536"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--max-model-len" in err and "128" in err


def test_serve_on_a_port_in_use_fails_before_loading_the_model(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvserve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port),
                     "--dtype", "float32"])
    assert code == 2
    assert f"cannot listen on 127.0.0.1 port {port}" in capsys.readouterr().err
    assert "Model loading took" not in caplog.text  # no engine was built


def test_bound_address_is_reserved_and_refuses_clients_until_served() -> None:
    """bind_sockets holds the port from before the engine starts (no other socket, a tensor-
    parallel rank's included, can take it), while a client that connects early is refused
    rather than left hanging on a server that is still loading."""
    socks = bind_sockets("127.0.0.1", 0)
    try:
        port = socks[0].getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as bind_error:
            other.bind(("127.0.0.1", port))
        assert bind_error.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))
    finally:
        for sock in socks:
            sock.close()
