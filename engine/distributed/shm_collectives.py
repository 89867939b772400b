"""All-reduce and all-gather through shared memory, for the tensor ranks of one stage on one
host's CPU.

gloo sends every collective through loopback TCP and its own threads: about 1.4 ms per
all-reduce on the 2-core machine of benchmark 13, which made 82% of a TP=2 decode step. Here
the ranks share one mapped file in /dev/shm: each writes its tensor into its own slot, bumps its
sequence counter, waits (spinning, then yielding) until every peer's counter has caught up, and
then sums (or gathers) all slots in rank order, so every rank computes bit-identical results.
Two slots per rank, used alternately, make one wait per collective enough: a rank can only
write slot k % 2 again after it has seen every peer publish collective k - 1, which each does
only after reading collective k - 2's slots.

A peer that dies mid-collective would leave the others spinning: the wait checks the peers'
processes every 0.2 s and raises naming the rank that exited (or after COLLECTIVE_TIMEOUT).
Tensors larger than a slot (long prefill chunks, the LM head's logits of a big batch) go through
gloo; the choice depends only on the shape, so every rank makes the same one. x86's
total store order keeps a slot's bytes visible before the counter written after them; other
architectures use gloo (`KVSERVE_SHM_COLLECTIVES=0` forces gloo anywhere).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 << 20  # per slot; 2 slots per rank
_HEADER_WORDS = 8  # int64s per rank (a cache line): [0] sequence, [1] pid
_CHECK_PEERS_S = 0.2
_SPINS_BEFORE_YIELD = 200


def shm_collectives_available() -> bool:
    """Whether this host can use them: Linux /dev/shm on x86-64, not disabled by env."""
    return (os.environ.get("KVSERVE_SHM_COLLECTIVES", "1") != "0" and SHM_DIR.is_dir()
            and platform.machine().lower() in ("x86_64", "amd64"))


def _exited(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (a dead child its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


class ShmCollectives:
    """One rank's view of its stage's shared segment (`path`, created by tensor rank 0)."""

    def __init__(self, path: Path, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        header = size * _HEADER_WORDS * 8
        total = header + size * 2 * SLOT_BYTES
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        self._mem = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        self._header = self._mem[:header].view(torch.int64).numpy()  # shared, not a copy
        self._header[rank * _HEADER_WORDS + 1] = os.getpid()
        self._slots = self._mem[header:]
        self._seq = 0

    def _slot(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        start = (rank * 2 + parity) * SLOT_BYTES
        nbytes = like.numel() * like.element_size()
        return self._slots[start:start + nbytes].view(like.dtype).view(like.shape)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through shared memory (else the caller uses gloo)."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _exchange(self, x: torch.Tensor) -> int:
        """Publishes `x` in this rank's next slot and waits until every peer has published
        theirs; returns the slots' parity."""
        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        self._slot(self.rank, parity, x).copy_(x)
        header, words = self._header, _HEADER_WORDS
        header[self.rank * words] = seq
        peers = [r for r in range(self.size) if r != self.rank]
        spins, started, checked = 0, time.monotonic(), 0.0
        while True:
            peers = [r for r in peers if header[r * words] < seq]
            if not peers:
                return parity
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now - checked >= _CHECK_PEERS_S:
                checked = now
                for r in peers:
                    pid = int(header[r * words + 1])
                    if pid and _exited(pid):
                        raise RuntimeError(f"tensor rank {r} (pid {pid}) exited during a "
                                           "shared-memory collective")
                if now - started > self.timeout_s:
                    raise RuntimeError(f"tensor ranks {peers} did not reach a shared-memory "
                                       f"collective within {self.timeout_s:.0f} s")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (rank order: the same bits on every rank)."""
        parity = self._exchange(x)
        x.copy_(self._slot(0, parity, x))
        for r in range(1, self.size):
            x.add_(self._slot(r, parity, x))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order (copies: the slots are reused)."""
        parity = self._exchange(x)
        return [self._slot(r, parity, x).clone() for r in range(self.size)]


def create_shm_collectives(store: Any, prefix: str, stage: int, rank: int, size: int,
                           timeout_s: float) -> ShmCollectives | None:
    """The stage's segment: tensor rank 0 creates it, the others map it, then it is unlinked
    (the mappings keep it alive, and nothing is left in /dev/shm if a rank crashes). None where
    shared-memory collectives are unavailable."""
    if size < 2 or not shm_collectives_available():
        return None
    path = SHM_DIR / f"{prefix}-stage{stage}"
    key = f"{prefix}/shm/{stage}"
    if rank != 0:
        store.wait([f"{key}/created"])
    shm = ShmCollectives(path, rank, size, timeout_s)
    if rank == 0:
        store.set(f"{key}/created", "1")
        store.wait([f"{key}/mapped/{r}" for r in range(1, size)])
        path.unlink(missing_ok=True)
    else:
        store.set(f"{key}/mapped/{rank}", "1")
    return shm
