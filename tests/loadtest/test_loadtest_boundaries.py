"""The load harness stands alone: its modules import nothing from engine/, server/ or kernels/
(the benchmarks in loadtest/benchmarks/ may), its tokenizer comes from transformers, and its
one server wrapper starts kvserve with or without a model argument."""

from __future__ import annotations

import ast
from pathlib import Path

from loadtest.datasets import LocalTokenizer, embedded_gguf
from loadtest.serve_process import kvserve_spec, peer_spec

HARNESS = Path(__file__).resolve().parents[2] / "loadtest"
ENGINE_PACKAGES = ("engine", "server", "kernels")


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every import in a file, at module level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_harness_modules_import_nothing_from_the_engine() -> None:
    modules = sorted(HARNESS.glob("*.py"))
    assert len(modules) > 10
    offenders = {p.name: sorted(imported_packages(p) & set(ENGINE_PACKAGES)) for p in modules}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_imported_packages_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from engine.config import X\n    import server\n")
    assert imported_packages(source) == {"os", "engine", "server"}


def test_kvserve_spec_passes_the_model_only_when_given(tmp_path: Path) -> None:
    default = kvserve_spec(None, 1, 4, tmp_path, [])
    assert default.argv[3:5] == ["serve", "--host"] and default.extra_body == {"ignore_eos": True}
    folder = kvserve_spec(tmp_path / "m", 1, 4, tmp_path, ["--max-model-len", "64"])
    assert folder.argv[4] == str(tmp_path / "m") and folder.argv[-2:] == ["--max-model-len", "64"]
    assert folder.port != 0 and folder.base_url == f"http://127.0.0.1:{folder.port}"
    peer = peer_spec(tmp_path / "m", 2, tmp_path, [])
    assert peer.env["OMP_NUM_THREADS"] == "2" and "generation_config" in peer.extra_body


def test_local_tokenizer_loads_a_folder_with_transformers(tiny_llama_dir: Path) -> None:
    tok = LocalTokenizer(str(tiny_llama_dir))
    ids = tok.encode("the river and the city")
    assert ids and tok.decode(ids) == "the river and the city"


def test_the_embedded_gguf_is_found_without_the_engine() -> None:
    from engine.model_loader.gguf.weights import default_model_path

    assert embedded_gguf() == default_model_path()
