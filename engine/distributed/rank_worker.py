"""The step protocol between rank 0 and ranks 1..N-1, and the loop those ranks run, for tensor
parallelism, pipeline parallelism and both.

Rank 0's model sends each call as plain tensors: a fixed header of ints on the world's gloo
group (the command and the sizes), then the call's tensors packed into one (token ids,
positions, slot mapping, query starts, sequence lengths, block tables; or the hidden rows for
the LM head) on the world's device group. Every other rank rebuilds the same call and runs it on
its part of the model (its tensor shard, its stage's layers or both), taking part in its
stage's collectives and passing hidden states on to the next stage; the ranks never see an
engine object, and they never sample.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import (
    ParallelGroups,
    connect_store,
    create_groups,
    rank_layout,
)
from engine.distributed.stage_link import GroupLink, stage_of_rank
from engine.models.parallel_layers import StepSender
from engine.models.pipeline_layers import PipelineStageLlama, StageSpec
from kernels.metadata import AttentionMetadata

HEADER_LEN = 8
CMD_FORWARD, CMD_LOGITS, CMD_SHUTDOWN, CMD_FINISH = 1, 2, 3, 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to start (plain values, pickled once at spawn)."""

    args: EngineArgs
    max_model_len: int
    rank: int  # in the world of tensor_parallel_size x pipeline_parallel_size ranks
    tensor_parallel_size: int
    pipeline_parallel_size: int
    host: str
    port: int
    prefix: str  # the engine's unique group namespace on the store
    num_threads: int
    parent_pid: int


class StepBroadcaster(StepSender):
    """Rank 0's side: checks the other ranks are alive, then sends each model call."""

    def __init__(self, groups: ParallelGroups, check_alive: Callable[[], None],
                 deferred: bool = False) -> None:
        self.groups = groups
        self.check_alive = check_alive
        # TP x PP under the batch queue: the last stage's tensor ranks run a launched step
        # only when rank 0 finishes it (FINISH on their own group), and take the logits rows
        # there too; the world group carries only the launches.
        self.deferred = deferred
        # Broadcasts sent without waiting (the batch queue's launches) and their tensors, which
        # must outlive them; dropped once complete.
        self._unsettled: deque[tuple[Any, torch.Tensor]] = deque()

    def _broadcast(self, x: torch.Tensor, idle: bool, wait: bool) -> None:
        if wait:
            self.groups.broadcast(x, idle=idle)
            return
        while self._unsettled and self._unsettled[0][0].is_completed():
            self._unsettled.popleft()
        self._unsettled.append((self.groups.broadcast_async(x, idle=idle), x))

    def _header(self, *values: int, wait: bool = True) -> None:
        self.check_alive()
        self._broadcast(_command(*values), True, wait)

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata, wait: bool = True) -> None:
        """Header: sizes, KV blocks, window, block size; payload: the flat int64 inputs.
        `wait=False` returns before the ranks have taken it (the pipeline's batch queue: the
        first stage takes the next batch while later stages still run the ones before)."""
        num_seqs, max_blocks = meta.block_tables.shape
        self._header(CMD_FORWARD, input_ids.shape[0], num_seqs, max_blocks,
                     kv_caches[0][0].shape[0], meta.sliding_window or -1, meta.block_size,
                     wait=wait)
        payload = torch.cat([input_ids.long(), positions.long(), meta.slot_mapping.long(),
                             meta.query_start_loc.long(), meta.seq_lens.long(),
                             meta.block_tables.long().flatten()])
        self._broadcast(payload, False, wait)

    def send_finish(self) -> None:
        """Deferred mode: the last stage's tensor ranks run the oldest launched step now."""
        self.check_alive()
        self.groups.broadcast_last_stage(_command(CMD_FINISH))

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Header: rows, hidden size, dtype; payload: the rows."""
        values = (CMD_LOGITS, hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype))
        if self.deferred:
            self.check_alive()
            self.groups.broadcast_last_stage(_command(*values))
            self.groups.broadcast_last_stage(hidden.contiguous())
            return
        self._header(*values)
        self.groups.broadcast(hidden.contiguous())

    def send_shutdown(self) -> None:
        """Tells the other ranks to leave their loop."""
        if self.deferred:
            self.groups.broadcast_last_stage(_command(CMD_SHUTDOWN))
        self.groups.broadcast(_command(CMD_SHUTDOWN))


def _command(*values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.long)
    header[:len(values)] = torch.tensor(values, dtype=torch.long)
    return header


def deferred_last_stage(args: EngineArgs) -> bool:
    """Whether the engine runs TP x PP under the batch queue (the last stage's tensor ranks
    then follow rank 0's finishes; see StepBroadcaster.deferred)."""
    return bool(args.async_scheduling and args.pipeline_parallel_size > 1
                and args.tensor_parallel_size > 1)


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


def _run_forward(runner: Any, groups: ParallelGroups, header: list[int]) -> None:
    """A FORWARD: its payload from the world group, then this rank's part of it."""
    if not runner.kv_caches or runner.kv_caches[0][0].shape[0] != header[4]:
        runner.allocate_kv_cache(header[4])
    payload = groups.broadcast(torch.empty(forward_payload_len(header), dtype=torch.long,
                                           device=groups.device))
    input_ids, positions, meta = unpack_forward(header, payload)
    runner.model(input_ids, positions, runner.kv_caches, meta)


def serve_steps(runner: object, groups: ParallelGroups) -> None:
    """Ranks 1..N-1: run rank 0's calls until SHUTDOWN (or until a collective, a send or a
    receive fails: a dead rank closes its sockets, and this one exits in turn). The logits
    rows go to every rank; only the last stage's tensor ranks compute theirs."""
    from engine.worker.model_runner import ModelRunner

    assert isinstance(runner, ModelRunner)
    if groups.last_stage_group is not None:
        serve_last_stage(runner, groups)
        return
    model, device = runner.model, groups.device
    holds_lm_head = not isinstance(model, PipelineStageLlama) or model.stage.is_last
    while True:
        header_t = torch.zeros(HEADER_LEN, dtype=torch.long)
        header = groups.broadcast(header_t, idle=True).tolist()
        if header[0] == CMD_SHUTDOWN:
            return
        with torch.inference_mode():
            if header[0] == CMD_FORWARD:
                _run_forward(runner, groups, header)
            elif header[0] == CMD_LOGITS:
                hidden = torch.empty(header[1], header[2], dtype=_DTYPES[header[3]],
                                     device=device)
                groups.broadcast(hidden)
                if holds_lm_head:
                    model.compute_logits(hidden)
            else:
                raise RuntimeError(f"rank {groups.world_rank} got an unknown command "
                                   f"{header[0]}")


def serve_last_stage(runner: Any, groups: ParallelGroups) -> None:
    """A tensor rank of the last stage under TP x PP's batch queue: it follows rank 0 on their
    own group. FINISH: take the oldest launch from the world group (sent before rank 0 finishes
    it) and run it, in step with rank 0's layers; LOGITS: the rows, then this rank's part of
    the logits. Launches are read only when finished, so rank 0's later launches never wait
    on this rank."""
    device = groups.device
    while True:
        header = groups.broadcast_last_stage(torch.zeros(HEADER_LEN, dtype=torch.long),
                                             idle=True).tolist()
        with torch.inference_mode():
            if header[0] == CMD_SHUTDOWN:
                _skip_launches(groups)
                return
            if header[0] == CMD_FINISH:
                launch = groups.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long)).tolist()
                if launch[0] != CMD_FORWARD:
                    raise RuntimeError(f"rank {groups.world_rank}: FINISH without a launch")
                _run_forward(runner, groups, launch)
            elif header[0] == CMD_LOGITS:
                hidden = torch.empty(header[1], header[2], dtype=_DTYPES[header[3]],
                                     device=device)
                runner.model.compute_logits(groups.broadcast_last_stage(hidden))
            else:
                raise RuntimeError(f"rank {groups.world_rank} got an unknown command "
                                   f"{header[0]}")


def _skip_launches(groups: ParallelGroups) -> None:
    """At SHUTDOWN: reads the world group up to its SHUTDOWN, dropping unfinished launches."""
    while True:
        header = groups.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long)).tolist()
        if header[0] != CMD_FORWARD:
            return
        groups.broadcast(torch.empty(forward_payload_len(header), dtype=torch.long,
                                     device=groups.device))


def _watch_parent(parent_pid: int) -> None:
    """Exits this rank when the engine process is gone (killed before it could reap us)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def run_rank(spec: RankSpec) -> None:
    """Entry point of a spawned rank: join the groups, load its part, serve steps."""
    # Ctrl-C and a SIGTERM to the whole process group reach rank 0 too, which drains and then
    # stops the ranks; a rank that outlives it exits by itself (_watch_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    # env:// style rendezvous: rank 0 chose the address and port.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = spec.host, str(spec.port)
    torch.set_num_threads(spec.num_threads)
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    store = connect_store(spec.host, spec.port, spec.rank, tp * pp)
    try:
        from engine.model_loader.loader import resolve_model
        from engine.worker.model_runner import ModelRunner

        device = spec.args.resolved_device()
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        torch.manual_seed(spec.args.seed)
        store.set(f"{spec.prefix}/joined/{spec.rank}", "1")
        groups = create_groups(store, spec.prefix, spec.rank, tp, pp, device,
                               deferred_last_stage(spec.args))
        source = resolve_model(spec.args.model)
        pp_index = rank_layout(spec.rank, tp)[0]
        stage = None if pp == 1 else StageSpec.of(source.config, stage_of_rank(pp_index, pp), pp)
        dtype = spec.args.resolved_dtype(device)
        runner = ModelRunner(source, spec.args, device, dtype, spec.max_model_len, groups, stage)
        if stage is not None:
            assert isinstance(runner.model, PipelineStageLlama)
            runner.model.link = GroupLink(groups, stage, dtype)
    except BaseException:
        store.set(f"{spec.prefix}/error/{spec.rank}", traceback.format_exc())
        raise
    store.set(f"{spec.prefix}/ready/{spec.rank}", "1")
    serve_steps(runner, groups)
