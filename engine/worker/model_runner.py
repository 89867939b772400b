"""The worker side: owns the weights, the KV tensors and the sampler; turns an immutable
batch into sampled tokens. It never touches scheduler state."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from engine.capacity import format_gib
from engine.config import FP8_KV_CACHE_DTYPES, EngineArgs, ModelConfig, effective_quantization
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepResult
from engine.cpu_features import auto_cpu_dtype
from engine.distributed.parallel_state import kv_heads_per_rank
from engine.model_loader.gguf.codes import GGUF_GROUP
from engine.model_loader.gguf.weights import iter_gguf_weights
from engine.model_loader.loader import ModelSource, iter_weights
from engine.models import build_model
from engine.models.cpu_linear import pack_linears
from engine.models.llama import LlamaForCausalLM
from engine.models.pipeline_layers import PipelineStageLlama, build_stage_model
from engine.quantization import (
    apply_plan,
    cast_float_parameters,
    quantize_model,
    resident_weight_bytes,
)
from engine.quantization.checkpoint import (
    CHECKPOINT_METHODS,
    CheckpointCodes,
    CheckpointQuantization,
    read_checkpoint_quantization,
)
from engine.sampling_params import SamplingParams
from engine.worker.cpu_path import CpuPathDecision, choose_cpu_path
from engine.worker.cuda_graphs import DecodeGraphRunner, capture_sizes
from engine.worker.input_batch import (
    BatchInputs,
    decode_batch,
    decode_rows,
    prepare_inputs,
    with_history,
)
from engine.worker.offload import CPUOffload, offload_to_cpu, place_on_device
from engine.worker.sampler import Sampler, argmax_rows
from kernels.selector import get_attention_backend

if TYPE_CHECKING:
    from engine.distributed.parallel_state import ParallelGroups
    from engine.models.pipeline_layers import StageSpec
    from engine.outputs import PositionLogprobs

logger = logging.getLogger("kvserve")


class ModelRunner:
    """Loads the model and runs steps; call everything from one worker thread."""

    def __init__(self, source: ModelSource, args: EngineArgs, device: torch.device,
                 dtype: torch.dtype, max_model_len: int,
                 parallel: ParallelGroups | None = None, stage: StageSpec | None = None) -> None:
        self.config: ModelConfig = source.config
        self.thread_id = threading.get_ident()  # the worker thread's (engine/worker/worker.py)
        self.parallel = parallel  # tensor-parallel groups: this runner holds one rank's shard
        self.stage = stage  # pipeline parallel: this runner holds one stage's layers
        self.args = args
        self.device = device
        self.dtype = dtype
        self.block_size = args.block_size
        # Refuses what the kernels cannot run (block size, fp8 on an older GPU) before loading.
        self.backend = get_attention_backend(args.attention_backend, device, args.block_size,
                                             self.kv_cache_dtype())
        self.offload: CPUOffload | None = None  # --cpu-offload-gb's weights in host memory
        self.quantization = "none"  # the method in effect, as _load_model settles it
        self.model = self._load_model(source, max_model_len)
        self.cpu_path: CpuPathDecision | None = None  # on CPU: how the forward runs
        self.choose_cpu_path()
        self.sampler = Sampler(device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graph_runner: DecodeGraphRunner | None = None
        self.max_model_len = max_model_len
        # The last step's sampled tokens: async scheduling's placeholders in the next step.
        self.last_sampled: dict[str, int] = {}
        # Pipeline parallel batch queue: launched batches and their inputs, oldest first.
        self._launched: deque[tuple[SchedulerOutput, BatchInputs | None]] = deque()

    def _load_model(self, source: ModelSource, max_model_len: int) -> LlamaForCausalLM:
        start = time.perf_counter()
        if self.args.dtype == "auto" and self.device.type == "cpu":
            dtype, why = auto_cpu_dtype()
            logger.info("--dtype auto: %s on this CPU: %s", str(dtype).removeprefix("torch."),
                        why)
        # A GGUF file's Q4 blocks stay in place by default where int4 runs fused (one rank, on
        # CPU: on CUDA a file's 5- and 8-bit blocks would dequantize per call; `--quantization
        # gguf` asks for it there).
        in_place = (self.device.type == "cpu"
                    and apply_plan("int4", self.dtype, self.device).fuses
                    and getattr(self.args, "tensor_parallel_size", 1) == 1
                    and getattr(self.args, "pipeline_parallel_size", 1) == 1)
        quantization = effective_quantization(self.args.quantization, self.config,
                                              source.kind, in_place)
        checkpoint = None
        if quantization in CHECKPOINT_METHODS or quantization == "gguf":
            quant = (CheckpointQuantization("gguf", GGUF_GROUP, 0) if quantization == "gguf"
                     else read_checkpoint_quantization(source.path))
            if self.args.load_format == "dummy" or quant is None:
                quantization = "int4"  # random weights: int4 at load has the same layout
            else:  # the checkpoint's codes, as stored
                checkpoint = CheckpointCodes(quant)
        self.quantization = quantization
        # Quantized methods start from float32 weights (not ones already rounded to 16 bits).
        load_dtype = self.dtype if quantization == "none" else torch.float32
        # On CUDA with an offload budget or a quantization method the model loads in host
        # memory first: the offloaded part never takes GPU memory (engine/worker/offload.py),
        # and the float32 weights a method starts from go to the GPU one layer at a time to
        # be quantized, so a model whose float32 copy outgrows the GPU still loads.
        offload = self.args.cpu_offload_gb > 0
        host_first = self.device.type == "cuda" and (offload or quantization != "none")
        with torch.device("meta"):
            model = build_model(self.config, self.backend, max_model_len, self.device,
                                self.parallel) if self.stage is None else \
                build_stage_model(self.config, self.backend, max_model_len, self.device,
                                  self.stage, self.parallel)
        model = model.to(dtype=load_dtype).to_empty(
            device=torch.device("cpu") if host_first else self.device)
        if self.config.tie_word_embeddings:  # to_empty unties shared parameters
            model.lm_head.weight = model.embed_tokens.weight
        if self.args.load_format == "dummy":
            _init_dummy_weights(model, self.device)
        else:
            if checkpoint is not None and quantization == "gguf":
                weights = iter_gguf_weights(source.path, load_dtype, checkpoint.layers)
            else:
                weights = iter_weights(source, load_dtype)
                weights = checkpoint.weights(weights) if checkpoint else weights
            model.load_weights(weights)
        how = "unquantized"
        if quantization != "none":
            report = quantize_model(model, quantization, self.dtype, self.device,
                                    self.args.quantization_group_size, checkpoint=checkpoint,
                                    place=torch.device("cpu") if offload else None)
            cast_float_parameters(model, self.dtype)
            how = (f"--quantization {quantization}: {report.fused_layers} of {report.layers} "
                   f"linear layers on a fused {'int8' if quantization == 'int8' else 'int4'} kernel, "
                   f"{report.layers - report.fused_layers} dequantized per call, activations "
                   f"in {str(report.compute_dtype).removeprefix('torch.')}; LM head "
                   f"{report.lm_head}")
        if self.device.type == "cpu":
            pack_linears(model)
        if host_first and not offload:
            place_on_device(model, self.device)  # the norms, embedding, any float layer
        self.offload = offload_to_cpu(model, self.args.cpu_offload_gb, self.device) \
            if offload else None
        self._weight_bytes = resident_weight_bytes(model) - self.offloaded_bytes()
        if self.offload is not None:
            how += f"; {format_gib(self.offloaded_bytes())} more offloaded to CPU memory"
        logger.info("Model loading took %s and %.2f seconds (%s weights, %s)",
                    format_gib(self._weight_bytes), time.perf_counter() - start,
                    str(self.dtype).removeprefix("torch."), how)
        if self.offload is not None and self.device.type == "cuda" and \
                not self.args.enforce_eager:
            logger.info("--cpu-offload-gb: decode steps run eagerly, as with --enforce-eager "
                        "(a captured CUDA graph would keep the offloaded weights' device copies "
                        "resident)")
        return model.eval()

    def choose_cpu_path(self) -> CpuPathDecision | None:
        """Chooses, logs and installs the model's CPU execution path (engine/worker/cpu_path.py);
        None off CPU. Runs once at load; a test that swaps a layer's attention backend after
        load calls it again, since the model never looks at its backends by itself."""
        if self.device.type != "cpu":
            return None
        self.cpu_path = choose_cpu_path(self.model, self.args, self.dtype, self.quantization,
                                        self.offload is not None)
        return self.cpu_path

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the device as loaded: quantized codes and scales where
        --quantization is on (tied tensors counted once), less what --cpu-offload-gb moved to
        host memory."""
        return self._weight_bytes

    def offloaded_bytes(self) -> int:
        """Bytes of weights --cpu-offload-gb keeps in host memory (0 without it)."""
        return 0 if self.offload is None else self.offload.offloaded_bytes

    def kv_cache_dtype(self) -> torch.dtype:
        """Element type of the KV tensors: the model dtype for `auto`, else the fp8 type."""
        return FP8_KV_CACHE_DTYPES.get(self.args.kv_cache_dtype, self.dtype)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode graphs need CUDA, a backend without host syncs (Triton) and no
        --enforce-eager."""
        return (self.device.type == "cuda" and not self.args.enforce_eager
                and self.offload is None  # the copies must not live in a graph's pool
                and self.parallel is None  # a graph cannot replay rank 0's step broadcasts
                and self.stage is None
                and bool(getattr(self.backend, "supports_cuda_graphs", False)))

    def _graph_runner(self, sizes: list[int]) -> DecodeGraphRunner:
        return DecodeGraphRunner(self.model, sizes, self.max_model_len, self.block_size,
                                 self.config.sliding_window, self.device, use_graphs=True)

    def profile_cuda_graph_bytes(self, max_num_seqs: int) -> int:
        """Memory the decode graphs will hold, measured by capturing the largest one against a
        one-block cache, so the KV budget can leave room for it; 0 without graphs."""
        if not self.uses_cuda_graphs:
            return 0
        self.allocate_kv_cache(1)
        probe = self._graph_runner([capture_sizes(max_num_seqs)[-1]])
        probe.capture(self.kv_caches)
        graph_bytes = probe.graph_bytes
        del probe
        self.kv_caches = []
        torch.cuda.empty_cache()
        return graph_bytes

    def init_cuda_graphs(self, max_num_seqs: int) -> None:
        """Captures the decode graphs; call after the KV cache is allocated."""
        if self.uses_cuda_graphs:
            self.graph_runner = self._graph_runner(capture_sizes(max_num_seqs))
            self.graph_runner.capture(self.kv_caches)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer: [num_blocks, block_size, kv_heads, head_dim]."""
        cfg = self.config
        kv_heads = cfg.num_key_value_heads if self.parallel is None else \
            kv_heads_per_rank(cfg, self.parallel.size)  # this rank's share
        shape = (num_blocks, self.block_size, kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device),
                           torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device))
                          for _ in range(cfg.num_hidden_layers if self.stage is None
                                         else self.stage.num_layers)]  # a stage: its layers

    def profile_batch(self, num_tokens: int) -> tuple[SchedulerOutput, int]:
        """The profiling step: `num_tokens` prompt tokens as few prompts as fit, none longer
        than max_model_len (a longer one would read positions past the rotary table); and the
        KV blocks it needs."""
        lengths = [min(self.max_model_len, num_tokens - start)
                   for start in range(0, num_tokens, self.max_model_len)]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        requests, first = [], 0
        for i, length in enumerate(lengths):
            count = -(-length // self.block_size)
            requests.append(ScheduledRequest(f"profile-{i}", tuple([0] * length), 0,
                                             tuple(range(first, first + count)), True, params))
            first += count
        return SchedulerOutput(tuple(requests)), first

    @torch.inference_mode()
    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        """Peak memory of one forward over `num_tokens` prompt tokens (CUDA only; 0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        batch, num_blocks = self.profile_batch(num_tokens)
        self.allocate_kv_cache(num_blocks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.execute(batch)
        self.last_sampled = {}
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Runs the model over the batch and samples where requests reached their end."""
        self.sampler.forget(batch.finished_request_ids)
        if not batch.requests:
            return StepResult()  # keeps last_sampled: the next step may fill placeholders
        previous, self.last_sampled = self.last_sampled, {}
        decode = decode_batch(batch, self.block_size, self.graph_runner, previous)
        if decode is not None:  # one graph replay instead of hundreds of launches
            assert self.graph_runner is not None
            hidden = self.graph_runner.run(decode, self.kv_caches)
            rows = list(batch.requests)
        else:
            # Every row decodes one token and samples: on the whole_step path with its ends the
            # step may be one C++ call, from the rows as lists (no tensors built for it).
            step = decode_rows(batch, self.block_size, previous) \
                if self.device.type == "cpu" else None
            if step is not None and self.cpu_path is not None and self.cpu_path.step_ends:
                rows = list(batch.requests)
                # Greedy rows that ask nothing else get their tokens from the step itself.
                argmax = self.sampler.argmax_only(rows)
                out = self.model.decode_logits(step, [row.block_ids for row in rows],
                                               self.kv_caches, self.config.sliding_window,
                                               argmax=argmax)
                if out is not None:  # the whole step was one C++ call
                    if argmax:
                        return self._result(rows, *self.sampler.took_argmax(out.tolist()))
                    return self._sample_logits(out, rows, previous)
            inputs = prepare_inputs(batch, self.block_size, self.config.sliding_window,
                                    self.device, previous, step)
            rows = inputs.sampling_rows
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if not rows:
                return StepResult()
            if len(rows) != hidden.shape[0]:
                hidden = hidden[inputs.logits_indices]
        return self._sample(hidden, rows, previous)

    def _sample(self, hidden: torch.Tensor, rows: list[ScheduledRequest],
                previous: dict[str, int]) -> StepResult:
        """Logits of the sampling rows' hidden states, sampled (greedy rows that ask nothing
        else: the argmax of the head's own output, not widened to float32 first)."""
        if self.sampler.argmax_only(rows):
            tokens = argmax_rows(self.model.greedy_logits(hidden)).tolist()
            return self._result(rows, *self.sampler.took_argmax(tokens))
        return self._sample_logits(self.model.compute_logits(hidden), rows, previous)

    def _sample_logits(self, logits: torch.Tensor, rows: list[ScheduledRequest],
                       previous: dict[str, int]) -> StepResult:
        """The sampling rows' logits, sampled."""
        return self._result(rows, *self.sampler.sample(logits, with_history(rows, previous)))

    def _result(self, rows: list[ScheduledRequest], tokens: list[int],
                logprobs: list[PositionLogprobs | None]) -> StepResult:
        """The step's result from the sampler's tokens (and logprobs) for the sampling rows."""
        grammar = self.sampler.last_grammar_result
        result = StepResult(grammar_terminated=grammar.terminated,
                            grammar_rejected=grammar.rejected)
        for row, token, lp in zip(rows, tokens, logprobs, strict=True):
            result.sampled[row.request_id] = token
            if lp is not None:
                result.logprobs[row.request_id] = lp
        self.last_sampled = result.sampled
        return result

    # ---- pipeline parallel batch queue (rank 0, the last stage) -----------------------------
    # Up to one batch per stage is in flight: `launch` sends a batch to the stages and returns
    # at once, so the first stage starts it while this stage still finishes an earlier one;
    # `finish` then runs this stage's layers on it and samples. Batches finish in launch order,
    # and the scheduler never puts a request in a batch while its token is in flight, so no row
    # carries a placeholder.

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> None:
        """Sends `batch` to the pipeline's stages without waiting for them."""
        assert isinstance(self.model, PipelineStageLlama)
        self.sampler.forget(batch.finished_request_ids)
        inputs = prepare_inputs(batch, self.block_size, self.config.sliding_window,
                                self.device) if batch.requests else None
        if inputs is not None:
            self.model.launch(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        self._launched.append((batch, inputs))

    @torch.inference_mode()
    def finish(self, batch: SchedulerOutput) -> StepResult:
        """This stage's part of the oldest launched batch (`batch`), sampled."""
        launched, inputs = self._launched.popleft()
        assert launched is batch, "batches finish in the order they were launched"
        if inputs is None:
            return StepResult()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            sent=True)
        if not inputs.sampling_rows:
            return StepResult()
        return self._sample(hidden[inputs.logits_indices], inputs.sampling_rows, {})


@torch.no_grad()
def _init_dummy_weights(model: torch.nn.Module, device: torch.device) -> None:
    """vLLM's `load_format=dummy`: small seeded random weights (norms at 1), drawn on
    `device`, for measuring a model shape without its checkpoint (the same values when
    --cpu-offload-gb loads the model in host memory first)."""
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif param.device == device:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.copy_(torch.empty_like(param, device=device).normal_(0.0, 0.02, generator=gen))
