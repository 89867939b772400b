"""kvserve's C++ CPU ops (kernels/cpu/) against their torch twins: paged decode attention read in
place, the KV write, the fused elementwise ops, the whole decode layer; and the fallback when
the ops cannot be built."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams, cpu_features
from engine.models.cpu_layer import (
    DENSE,
    INT4,
    INT4_TILES,
    INT8,
    INT8_TILES,
    PACKED,
    FusedLayer,
    FusedStack,
)
from engine.models.llama import RMSNorm
from engine.models.rope import RotaryEmbedding
from engine.quantization import tiles
from kernels import cpu_ops
from kernels import torch_attention as torch_ops
from kernels.cpu_attention import CpuAttentionBackend
from kernels.metadata import FP8_DTYPES
from kernels.selector import get_attention_backend
from tests.support.cpu_ops import require_cpu_ops
from tests.support.greedy import logprob_agreement, tokens_and_logprobs
from tests.support.paged_batches import make_meta, random_cache

OPS = require_cpu_ops()
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
NUM_BLOCKS, HEAD_DIM = 64, 32


def attention_case(query_lens: list[int], context_lens: list[int], *, heads: int = 4,
                   kv_heads: int = 2, dtype: torch.dtype = torch.float32,
                   cache_dtype: torch.dtype | None = None, window: int | None = None,
                   block_size: int = 16, scales: tuple[float, float] = (1.0, 1.0),
                   head_dim: int = HEAD_DIM, query_scale: float = 1.0) -> None:
    """The CPU backend's attention equals the torch twin's on one random batch."""
    torch.manual_seed(sum(query_lens) + sum(context_lens) + heads + block_size)
    cache_dtype = cache_dtype or dtype
    num_blocks = NUM_BLOCKS + sum(-(-(c + q) // block_size)
                                  for q, c in zip(query_lens, context_lens, strict=True))
    meta = make_meta(query_lens, context_lens, num_blocks, window, block_size)
    k_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, scales[0])
    v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, scales[1])
    query = (torch.randn(sum(query_lens), heads, head_dim) * query_scale).to(dtype)
    scale = head_dim ** -0.5
    want = torch_ops.unified_attention(query, k_cache, v_cache, meta, scale, *scales)
    meta._torch_plan = None
    got = CpuAttentionBackend(OPS).attention(query, k_cache, v_cache, meta, scale, *scales)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [(4, 4), (6, 2), (8, 1)])
def test_decode_attention_matches_torch(dtype: torch.dtype, group: tuple[int, int]) -> None:
    attention_case([1, 1, 1, 1], [0, 5, 40, 130], heads=group[0], kv_heads=group[1],
                   dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [(4, 4), (6, 2), (8, 1), (12, 1)])
@pytest.mark.parametrize("block_size, window", [(16, None), (1, None), (32, 7)])
def test_avx512_decode_attention_head_sizes(dtype: torch.dtype, head_dim: int,
                                            group: tuple[int, int], block_size: int,
                                            window: int | None) -> None:
    """The float32 and bf16 caches' AVX-512 kernel (attention_avx512.cpp: head sizes
    64/128/256, query heads per KV head below, at and above its register passes), or the
    generic one elsewhere."""
    attention_case([1, 1, 1, 1], [0, 5, 40, 130], heads=group[0], kv_heads=group[1],
                   dtype=dtype, head_dim=head_dim, block_size=block_size, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contexts, window, group", [
    ([3000], None, (9, 3)), ([2600], 1100, (9, 3)), ([1500, 40], None, (8, 1)),
    ([700], 600, (9, 3)), ([1500, 40], None, (9, 3))])
def test_avx512_decode_attention_splits_long_contexts(dtype: torch.dtype, contexts: list[int],
                                                      window: int | None,
                                                      group: tuple[int, int]) -> None:
    """Few sequences with long contexts split their keys over the threads (attention_avx512.cpp,
    key_parts: parts of at least 512 keys, unnormalised sums merged by their maxes), with 2
    threads as on CI's 2 cores: equal to the twin, with a window, and with a short sequence
    beside a long one (its parts past its context stay empty). The last two cases do not
    split (a window of 600 keys; 6 items for 2 threads). Queries 4x randn make the parts'
    maxes differ by several units, so a merge that weighs the parts wrongly fails."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        attention_case([1] * len(contexts), contexts, heads=group[0], kv_heads=group[1],
                       dtype=dtype, head_dim=64, window=window, query_scale=4.0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_attention_block_sizes(block_size: int) -> None:
    attention_case([1, 1], [3, 70], block_size=block_size)


@pytest.mark.parametrize("window", [1, 7, 64])
def test_decode_attention_sliding_window(window: int) -> None:
    attention_case([1, 1, 1], [2, 30, 90], window=window)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_fp8_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    attention_case([1, 1, 1], [9, 33, 64], dtype=dtype, cache_dtype=cache_dtype,
                   scales=(0.5, 1.7))


@pytest.mark.parametrize("window", [None, 11])
def test_mixed_batch_matches_torch(window: int | None) -> None:
    """Decode rows in place beside prefill chunks (with and without a cached prefix)."""
    attention_case([1, 20, 1, 7, 1], [33, 0, 78, 21, 0], window=window)


MIXED = ([1, 37, 1, 70, 3], [50, 0, 9, 130, 400])  # chunks across tiles, lanes and blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [32, 36, 40, 64, 128])
def test_varlen_attention_matches_torch(dtype: torch.dtype, group: tuple[int, int],
                                        head_dim: int) -> None:
    """varlen_attention (prefill chunks attending over their cached prefix and causally over
    themselves, beside decodes, read in place) against the torch twin's gather + SDPA; bf16
    head sizes that are multiples of 16 take the AVX512-BF16 dot products where built."""
    attention_case(*MIXED, heads=group[0], kv_heads=group[1], dtype=dtype, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_varlen_attention_blocks_and_windows(block_size: int, window: int | None) -> None:
    attention_case(*MIXED, block_size=block_size, window=window)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_fp8_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    attention_case(*MIXED, dtype=dtype, cache_dtype=cache_dtype, scales=(0.5, 1.7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 700])
def test_varlen_attention_split_context(dtype: torch.dtype, window: int | None) -> None:
    """Short chunks deep into long contexts: their keys are split over several items whose
    partial sums are merged (with one thread or many)."""
    attention_case([3, 1, 5], [2000, 10, 1300], dtype=dtype, window=window)


def test_varlen_attention_fresh_prefills() -> None:
    """Whole prompts with no cached prefix (the torch twin's causal SDPA), one of them long."""
    attention_case([45, 300, 2], [0, 0, 0])


@pytest.mark.parametrize("cache_dtype", [torch.float32, *FP8_DTYPES])
def test_write_kv_matches_torch(cache_dtype: torch.dtype) -> None:
    """Bit for bit, with a padding slot (-1) and values beyond fp8's range (saturate)."""
    torch.manual_seed(3)
    key = torch.randn(5, 2, 3 * HEAD_DIM)[:, :, :HEAD_DIM] * 300  # strided like qkv's views
    value = torch.randn(5, 2, HEAD_DIM) * 1e5
    slots = torch.tensor([7, -1, 0, 63, 30], dtype=torch.long)
    caches = [torch.zeros(4, 16, 2, HEAD_DIM, dtype=cache_dtype) for _ in range(4)]
    torch_ops.reshape_and_cache(key, value, caches[0], caches[1], slots, 0.7, 2.0)
    OPS.write_kv(key, value, caches[2], caches[3], slots, 0.7, 2.0)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_elementwise_ops_match_torch(dtype: torch.dtype) -> None:
    """Each fused op equals the torch formulation it replaces; bfloat16 rounds where it rounds."""
    torch.manual_seed(5)
    x = torch.randn(6, 96).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    exact: dict[str, Any] = {"atol": 0, "rtol": 0} if dtype != torch.float32 else {}
    want = norm(x)
    got = OPS.rms_norm(x, norm.weight, 1e-5)
    # The sum of squares is reduced in another order: one bfloat16 step at most.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=8e-3)

    # silu's own exp: bfloat16 results equal torch's bit for bit (checked on 1.5M values),
    # float32 ones within a few ulp; magnitudes far past exp's clamp, and a strided input.
    for gate_up in (torch.randn(6, 64).to(dtype), (torch.randn(64, 3072) * 30).to(dtype),
                    torch.randn(9, 200).to(dtype)[:, 40:104]):
        inter = gate_up.shape[1] // 2
        gate, up = gate_up.split(inter, dim=-1)
        torch.testing.assert_close(OPS.silu_and_mul(gate_up),
                                   torch.nn.functional.silu(gate) * up, **exact)

    qkv = torch.randn(6, 5 * HEAD_DIM).to(dtype)
    angles = torch.rand(6, 1, HEAD_DIM // 2) * 6
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    qk = qkv[:, :4 * HEAD_DIM].view(6, 4, HEAD_DIM)
    want_qk = RotaryEmbedding.apply(qk, cos, sin)
    OPS.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, want_qk, **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_add_then_norm(dtype: torch.dtype) -> None:
    """residual += h exactly as `residual + h` rounds; h becomes the norm of the new residual."""
    torch.manual_seed(6)
    x, h = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    residual, out = x.clone(), h.clone()
    OPS.add_rms_norm_(out, residual, norm.weight, 1e-6)
    torch.testing.assert_close(residual, x + h, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), norm(x + h).float(), atol=1e-5, rtol=8e-3)


# ---- the whole layer and the engine ---------------------------------------------------------


def step_rows(llm: LLM, rows: int, chunk: int = 0) -> tuple[Any, Any]:
    """A batch of `rows` decodes, and with `chunk` a prefill chunk of that many tokens after a
    cached prefix of 11, for the engine's model: its runner and prepared inputs."""
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from engine.worker.input_batch import prepare_inputs

    runner = llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=1)
    requests = [ScheduledRequest(f"r{i}", (5 + i,), 10 + 7 * i, tuple(range(4 * i, 4 * i + 4)),
                                 True, params) for i in range(rows)]
    if chunk:
        vocab = runner.model.config.vocab_size
        requests.append(ScheduledRequest("chunk", tuple(7 + i % (vocab - 7) for i in range(chunk)), 11,
                                         tuple(range(40, 40 + -(-(11 + chunk) // 8))), True,
                                         params))
    inputs = prepare_inputs(SchedulerOutput(tuple(requests)), runner.block_size, None,
                            runner.device, {})
    return runner, inputs


fused_call = FusedLayer.__call__
stack_call = FusedStack.__call__


@pytest.mark.parametrize("chunk", [0, 21, 600])  # 600: the MLP in two calls (kMlpRows)
@pytest.mark.parametrize("quantization, torch_layouts, dtype", [
    ("none", False, "bfloat16"), ("int8", False, "bfloat16"), ("int4", False, "bfloat16"),
    ("int8", True, "bfloat16"), ("int4", True, "bfloat16"), ("int8", False, "float32"),
    ("int4", False, "float32")])
def test_fused_layer_equals_python_layer(tiny_llama_dir: Path, quantization: str,
                                         torch_layouts: bool, dtype: str, chunk: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """decoder_layer_ (one C++ call), DecoderStack (every layer in one call) and the layer's
    Python forward over the same ops give the same hidden states, for each weight format the op runs (kvserve's tiled int8/int4 where
    built with AVX512-VNNI, and torch's, forced by hiding the tiled ops), on decode rows and on
    a mixed batch (a prefill chunk beside them). A float32 model runs the tiles on its float32
    activations (no bfloat16 round trip), so the op serves it too."""
    if torch_layouts:
        monkeypatch.setattr(tiles, "tile_ops", lambda: None)
    if dtype == "float32":  # this CPU's real flags: float32 models run fused on native bf16 ones
        flags = cpu_features.parse_cpu_flags(cpu_features.CPUINFO_PATH.read_text())
        monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: flags)
    llm = LLM(str(tiny_llama_dir), dtype=dtype, quantization=quantization,
              quantization_group_size=32 if quantization == "int4" else None,
              kv_cache_memory_bytes=2**20, block_size=8)
    runner, inputs = step_rows(llm, 2, chunk)
    model: Any = runner.model
    # float32 models keep the tiled layout on every CPU the ops build for
    assert dtype != "float32" or "layout_tiles" in model.layers[0].mlp.down_proj.tensors()

    # What the whole_step path installed at load (engine/worker/cpu_path.py): the stack, and
    # each layer's op beside it; taken away in turn to run the other two forms.
    fused_layers, whole = [layer._fused for layer in model.layers], model._fused_stack

    def run(state: str) -> torch.Tensor:
        for layer, fused in zip(model.layers, fused_layers, strict=True):
            layer._fused = None if state == "python" else fused
        model._fused_stack = whole if state == "stack" else None
        with torch.inference_mode():
            return model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)

    python = llm.engine.worker.call(run, "python")
    calls, stack_calls = [], []
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, *a: calls.append(1) or
                        fused_call(self, *a))
    monkeypatch.setattr(FusedStack, "__call__", lambda self, *a: stack_calls.append(1) or
                        stack_call(self, *a))
    stacked = llm.engine.worker.call(run, "stack")
    stack = whole
    if stack.max_rows is not None and inputs.input_ids.shape[0] > stack.max_rows:
        pytest.skip(f"torch's kernel here takes at most {stack.max_rows} rows in the op")
    assert stack_calls == [1] and not calls  # the layers ran inside the stack's one call
    torch.testing.assert_close(stacked, python, atol=0, rtol=0)
    fused = llm.engine.worker.call(run, "fused")
    assert len(calls) == len(model.layers)
    kinds = {k for layer in model.layers if isinstance(layer._fused, FusedLayer)
             for k in layer._fused.kinds}
    tiled = tiles.tile_ops() is not None
    expected = {"none": {PACKED, DENSE}, "int8": {INT8_TILES if tiled else INT8},
                "int4": {INT4_TILES if tiled else INT4}}[quantization]
    assert kinds and kinds <= expected
    torch.testing.assert_close(fused, python, atol=0, rtol=0)
    llm.engine.shutdown()


def test_stack_serves_what_every_layer_serves(tiny_llama_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack's one check per step (FusedStack.serves) says what its layers' own checks
    say: torch's int8 kernel serves up to its row crossover, above it the Python layers run."""
    from engine.quantization.methods import Int8Method

    monkeypatch.setattr(tiles, "tile_ops", lambda: None)
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="int8",
              kv_cache_memory_bytes=2**20, block_size=8)
    model: Any = llm.engine.runner.model
    stack = model._fused_stack
    limit = Int8Method.max_fused_rows
    assert stack is not None and limit is not None and stack.max_rows == limit
    for rows in (1, limit, limit + 1):
        each = all(f.serves(rows) for f in stack.layers)
        assert stack.serves(rows) == each == (rows <= limit), rows
    llm.engine.shutdown()


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5,
                                                ignore_eos=True), use_tqdm=False)
    llm.engine.shutdown()
    return tokens_and_logprobs(outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_cpu_ops_equals_torch_backend(tiny_llama_dir: Path, dtype: str) -> None:
    """Whole engine, greedy with logprobs: the C++ path against plain torch ops. float32 agrees
    token for token; in bfloat16 a random tiny model's near-ties flip on the last rounding of an
    attention sum (accumulated in another order), so the check there is the logprob rule."""
    runs = {backend: greedy(LLM(str(tiny_llama_dir), dtype=dtype, attention_backend=backend,
                                kv_cache_memory_bytes=2**20, block_size=8))
            for backend in ("cpu", "torch")}
    agreed, mad, rule = logprob_agreement(runs["torch"], runs["cpu"])
    if dtype == "float32":
        assert agreed == 1.0 and mad < 1e-4
    else:
        assert agreed >= 0.6 and mad < 0.05 and rule


def test_missing_compiler_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """No compiler and no build: load() gives None with a WARNING, `auto` picks the torch twins
    and `cpu` is refused naming the way out."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_ops.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve"):
            assert cpu_ops.load() is None
            assert "no C++ compiler" in caplog.text
            cpu = torch.device("cpu")
            assert isinstance(get_attention_backend("auto", cpu),
                              torch_ops.TorchAttentionBackend)
            with pytest.raises(ValueError, match="--attention-backend torch"):
                get_attention_backend("cpu", cpu)
    finally:
        cpu_ops.reset()
        monkeypatch.undo()
        assert cpu_ops.load() is not None


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    cpu_ops.reset()
    try:
        assert cpu_ops.load() is None
    finally:
        cpu_ops.reset()
        monkeypatch.undo()
        assert cpu_ops.load() is not None

