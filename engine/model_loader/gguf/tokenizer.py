"""The tokenizer of a GGUF checkpoint, converted by transformers and cached on disk.

transformers' conversion of a 50k vocabulary takes ~10 s, so `load_gguf_tokenizer` saves its
result once per file and transformers version, and later loads read that folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_loader.gguf.format import check_gguf_file, read_gguf_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("kvserve")

TOKENIZER_CACHE_SUBDIR = Path("kvserve", "tokenizers")


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Builds a transformers tokenizer from the GGUF's vocabulary, with its chat template.

    transformers' conversion takes ~10 s for a 50k vocabulary, so its result is saved with
    `save_pretrained` under `tokenizer_cache_dir(path)` and later calls load that folder
    instead. When the folder cannot be written, every call converts (and logs why).
    """
    from transformers import AutoTokenizer  # slow import, only needed here

    path = Path(path)
    check_gguf_file(path)
    cache = tokenizer_cache_dir(path)
    if cache.is_dir():  # complete by construction: _store_tokenizer renames it into place
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    tokenizer = _convert_tokenizer(path)
    _store_tokenizer(tokenizer, cache)
    return tokenizer


def tokenizer_cache_dir(path: str | Path) -> Path:
    """The folder that holds `path`'s converted tokenizer, under the user's cache directory.

    That is $XDG_CACHE_HOME (the standard location, ~/.cache when unset) / kvserve/tokenizers.
    The key hashes the file's resolved path, size and mtime and the transformers and tokenizers
    versions, so an edited file or an upgrade converts afresh instead of reusing stale output.
    """
    import tokenizers
    import transformers

    path = Path(path).resolve()
    stat = path.stat()
    identity = "\0".join([str(path), str(stat.st_size), str(stat.st_mtime_ns),
                          transformers.__version__, tokenizers.__version__])
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return _user_cache_root() / TOKENIZER_CACHE_SUBDIR / key


def _user_cache_root() -> Path:
    """$XDG_CACHE_HOME when set to an absolute path (as the XDG spec asks), else ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return Path(root) if os.path.isabs(root) else Path.home() / ".cache"


def _convert_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF vocabulary conversion, plus the chat template when it drops it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = read_gguf_header(path).metadata.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def _store_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> bool:
    """Saves into a staging sibling renamed to `folder`, so no reader sees half a tokenizer.

    False (after a warning) when the cache cannot be written; True when `folder` now exists,
    also when a concurrent process renamed its copy into place first.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    except OSError as e:
        logger.warning("tokenizer cache %s is not writable (%s); the GGUF tokenizer will be "
                       "converted again on every load", folder.parent, e)
        return False
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(folder)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():
            logger.warning("could not cache the GGUF tokenizer in %s (%s)", folder, e)
        return folder.is_dir()
    return True
