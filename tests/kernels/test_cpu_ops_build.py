"""Building kvserve's CPU ops: a build killed midway must not hang every later start."""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from kernels import cpu_ops


def test_a_lock_left_by_an_interrupted_build_is_removed(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """torch's tooling waits while its `lock` file exists; a killed build leaves one. The next
    build removes it, under an OS lock that another process cannot take meanwhile."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    name = f"kvserve_cpu_ops_{cpu_ops.build_key()}"
    folder = cpu_ops.cache_dir() / name
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a build killed midway leaves
    seen: list[str] = []

    def fake_load(**kwargs: Any) -> None:
        assert not (Path(kwargs["build_directory"]) / "lock").exists()
        with open(folder / "kvserve.flock", "w") as other:
            with pytest.raises(BlockingIOError):  # held by the build in progress
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (folder / f"{name}.so").touch()
        seen.append(kwargs["name"])

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert cpu_ops.build() == folder / f"{name}.so"
    assert seen == [name] and "interrupted" in caplog.text
    assert cpu_ops.build() == folder / f"{name}.so" and seen == [name]  # built: no second run
