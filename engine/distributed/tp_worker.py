"""The step protocol between rank 0 and ranks 1..N-1, and the loop those ranks run.

Rank 0's model sends each call as plain tensors: a fixed header of ints on the gloo group (the
command and the sizes), then the call's tensors packed into one (token ids, positions, slot
mapping, query starts, sequence lengths, block tables; or the hidden rows for the LM head) on
the device group. Ranks 1..N-1 rebuild the same call and run it on their shard, taking part in
its collectives; they never see an engine object, and they never sample.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelGroups, connect_store, create_groups
from engine.models.parallel_layers import StepSender, TensorParallelLlama
from kernels.metadata import AttentionMetadata

HEADER_LEN = 8
CMD_FORWARD, CMD_LOGITS, CMD_SHUTDOWN = 1, 2, 3
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to start (plain values, pickled once at spawn)."""

    args: EngineArgs
    max_model_len: int
    rank: int
    size: int
    host: str
    port: int
    prefix: str  # the engine's unique group namespace on the store
    num_threads: int
    parent_pid: int


class StepBroadcaster(StepSender):
    """Rank 0's side: checks the other ranks are alive, then sends each model call."""

    def __init__(self, groups: ParallelGroups, check_alive: Callable[[], None]) -> None:
        self.groups = groups
        self.check_alive = check_alive

    def _header(self, *values: int) -> None:
        self.check_alive()
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[:len(values)] = torch.tensor(values, dtype=torch.long)
        self.groups.broadcast(header, idle=True)

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> None:
        """Header: sizes, KV blocks, window, block size; payload: the flat int64 inputs."""
        num_seqs, max_blocks = meta.block_tables.shape
        self._header(CMD_FORWARD, input_ids.shape[0], num_seqs, max_blocks,
                     kv_caches[0][0].shape[0], meta.sliding_window or -1, meta.block_size)
        payload = torch.cat([input_ids.long(), positions.long(), meta.slot_mapping.long(),
                             meta.query_start_loc.long(), meta.seq_lens.long(),
                             meta.block_tables.long().flatten()])
        self.groups.broadcast(payload)

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Header: rows, hidden size, dtype; payload: the rows."""
        self._header(CMD_LOGITS, hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype))
        self.groups.broadcast(hidden.contiguous())

    def send_shutdown(self) -> None:
        """Tells the other ranks to leave their loop."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0] = CMD_SHUTDOWN
        self.groups.broadcast(header)


def unpack_forward(header: list[int], payload: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Rebuilds (input_ids, positions, metadata) from a FORWARD header and payload."""
    num_tokens, num_seqs, max_blocks, _, window, block_size = header[1:7]
    parts = payload.split([num_tokens] * 3 + [num_seqs + 1, num_seqs, num_seqs * max_blocks])
    input_ids, positions, slots, starts, seq_lens, tables = parts
    starts_list, seq_lens_list = starts.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=starts.int(), seq_lens=seq_lens.int(),
        block_tables=tables.view(num_seqs, max_blocks).int(),
        query_lens_list=[b - a for a, b in zip(starts_list, starts_list[1:], strict=False)],
        seq_lens_list=seq_lens_list, block_size=block_size,
        sliding_window=None if window < 0 else window)
    return input_ids, positions, meta


def forward_payload_len(header: list[int]) -> int:
    """Elements of a FORWARD payload."""
    num_tokens, num_seqs, max_blocks = header[1:4]
    return 3 * num_tokens + 2 * num_seqs + 1 + num_seqs * max_blocks


def serve_steps(runner: object, groups: ParallelGroups) -> None:
    """Ranks 1..N-1: run rank 0's calls until SHUTDOWN (or until a collective fails)."""
    from engine.worker.model_runner import ModelRunner

    assert isinstance(runner, ModelRunner) and isinstance(runner.model, TensorParallelLlama)
    model, device = runner.model, groups.device
    while True:
        header_t = torch.zeros(HEADER_LEN, dtype=torch.long)
        header = groups.broadcast(header_t, idle=True).tolist()
        if header[0] == CMD_SHUTDOWN:
            return
        with torch.inference_mode():
            if header[0] == CMD_FORWARD:
                if not runner.kv_caches or runner.kv_caches[0][0].shape[0] != header[4]:
                    runner.allocate_kv_cache(header[4])
                payload = groups.broadcast(torch.empty(forward_payload_len(header),
                                                       dtype=torch.long, device=device))
                input_ids, positions, meta = unpack_forward(header, payload)
                model(input_ids, positions, runner.kv_caches, meta)
            elif header[0] == CMD_LOGITS:
                hidden = torch.empty(header[1], header[2], dtype=_DTYPES[header[3]],
                                     device=device)
                model.compute_logits(groups.broadcast(hidden))


def _watch_parent(parent_pid: int) -> None:
    """Exits this rank when the engine process is gone (killed before it could reap us)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def run_rank(spec: RankSpec) -> None:
    """Entry point of a spawned rank: join the groups, load the shard, serve steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    # env:// style rendezvous: rank 0 chose the address and port.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = spec.host, str(spec.port)
    torch.set_num_threads(spec.num_threads)
    store = connect_store(spec.host, spec.port, spec.rank, spec.size)
    try:
        from engine.model_loader.loader import resolve_model
        from engine.worker.model_runner import ModelRunner

        device = spec.args.resolved_device()
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        torch.manual_seed(spec.args.seed)
        store.set(f"{spec.prefix}/joined/{spec.rank}", "1")
        groups = create_groups(store, spec.prefix, spec.rank, spec.size, device)
        runner = ModelRunner(resolve_model(spec.args.model), spec.args, device,
                             spec.args.resolved_dtype(device), spec.max_model_len, groups)
    except BaseException:
        store.set(f"{spec.prefix}/error/{spec.rank}", traceback.format_exc())
        raise
    store.set(f"{spec.prefix}/ready/{spec.rank}", "1")
    serve_steps(runner, groups)
