"""The shared-memory all-reduce and all-gather of CPU tensor ranks
(engine/distributed/shm_collectives.py), between real processes: sums and gathers equal the
plain torch ones and are bit-identical on every rank, slots alternate safely over many rounds,
tensors over a slot are left to gloo, the segment leaves nothing in /dev/shm, a dead peer
raises instead of hanging, and a TP engine uses them."""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.distributed.shm_collectives import (
    SHM_DIR,
    SLOT_BYTES,
    create_shm_collectives,
    shm_collectives_available,
)

pytestmark = pytest.mark.skipif(not shm_collectives_available(),
                                reason="needs /dev/shm on x86-64")
ROUNDS = 200


def _inputs(rank: int, i: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(3 + i % 5, 37, generator=gen, dtype=torch.float32)


def _member(rank: int, size: int, port: int, prefix: str, out: str, die_after: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, size, False, wait_for_workers=False)
    shm = create_shm_collectives(store, prefix, 0, rank, size, 30.0)
    assert shm is not None
    results = []
    for i in range(ROUNDS):
        if i == die_after:
            os._exit(0)
        x = _inputs(rank, i)
        results.append((shm.all_reduce(x.clone()), shm.all_gather(x)))
    torch.save(results, out)


def _run(size: int, tmp_path: Path, die_after: int = -1
         ) -> tuple[list[BaseException | None], list[Path]]:
    """Ranks 1..size-1 in spawned processes, rank 0 here; returns rank 0's error per round
    set (or None) and every rank's results file."""
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
    prefix = f"kvserve-test-{uuid.uuid4().hex[:8]}"
    outs = [tmp_path / f"rank{r}.pt" for r in range(size)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, size, store.port, prefix, str(outs[r]),
                                                die_after), daemon=True)
             for r in range(1, size)]
    for proc in procs:
        proc.start()
    shm = create_shm_collectives(store, prefix, 0, 0, size, 30.0)
    assert shm is not None
    assert not any(p.name.startswith(prefix) for p in SHM_DIR.iterdir())  # unlinked once mapped
    errors: list[BaseException | None] = []
    results = []
    try:
        for i in range(ROUNDS):
            x = _inputs(0, i)
            results.append((shm.all_reduce(x.clone()), shm.all_gather(x)))
    except RuntimeError as exc:
        errors.append(exc)
    torch.save(results, outs[0])
    for proc in procs:
        proc.join(30)
    return errors, outs


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_match_torch_on_every_rank(size: int, tmp_path: Path) -> None:
    errors, outs = _run(size, tmp_path)
    assert errors == []
    per_rank = [torch.load(path) for path in outs]
    for i in range(ROUNDS):
        parts = [_inputs(r, i) for r in range(size)]
        expected = parts[0].clone()
        for part in parts[1:]:
            expected += part  # rank order, as every rank sums
        for rank in range(size):
            reduced, gathered = per_rank[rank][i]
            assert torch.equal(reduced, expected), (i, rank)
            assert all(torch.equal(g, p) for g, p in zip(gathered, parts, strict=True))


def test_a_dead_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    started = time.monotonic()
    errors, _ = _run(2, tmp_path, die_after=50)
    assert len(errors) == 1 and "tensor rank 1" in str(errors[0])
    assert "exited during a shared-memory collective" in str(errors[0])
    assert time.monotonic() - started < 20


def test_big_tensors_are_left_to_gloo(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert create_shm_collectives(store, "kvserve-test-one", 0, 0, 1, 1.0) is None  # 1 rank
    from engine.distributed.shm_collectives import ShmCollectives

    path = tmp_path / "segment"
    shm = ShmCollectives(path, 0, 2, 1.0)
    assert shm.fits(torch.empty(SLOT_BYTES // 4, dtype=torch.float32))
    assert not shm.fits(torch.empty(SLOT_BYTES // 4 + 1, dtype=torch.float32))
    assert not shm.fits(torch.empty(4, dtype=torch.float32, device="meta"))


def test_tp_engine_uses_them(tiny_llama_dir: Path) -> None:
    from engine.llm import LLM
    from tests.engine.test_tensor_parallel import ENGINE_KWARGS

    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        tp = llm.engine.tp
        assert tp is not None and tp.groups.shm is not None
        before = tp.groups.shm._seq
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
        assert tp.groups.shm._seq > before
    finally:
        llm.engine.shutdown()
