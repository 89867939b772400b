// kvserve's CPU ops (loaded by kernels/cpu_ops.py, which builds this file with torch's
// extension tooling at setup):
//
//   decode_attention  one query token per sequence attending over its context, reading K/V
//                     through the block table where they lie in the paged cache (no gather),
//                     with GQA (a KV row is read once for all query heads sharing it), a
//                     sliding window and fp8 caches (e4m3fn / e5m2, read through a table);
//   varlen_attention  the same for a mixed batch: prefill chunks (each query token attending
//                     causally over its cached prefix and its chunk) beside decodes, tiled
//                     flash-style over the blocks in place (attention/varlen_attention.cpp);
//   write_kv          this step's K/V rows into their cache slots (slot -1 skipped), fp8
//                     quantised with saturation as the torch twin does;
//   rms_norm, add_rms_norm_, silu_and_mul, rotary_
//                     the decoder layer's elementwise work, one pass each instead of 4-8
//                     torch ops, rounding where the torch formulation rounds (so bfloat16
//                     results match the eager model's).
//
//   q4_linear, u5_linear, u8_linear, q8_linear
//                     weight-only 4-, 5- and 8-bit codes (a scale and min per group of blocks
//                     of 32) and int8 (per row) linear layers, in tiles of 16 rows for
//                     the vector layer's int8 dot product (quant/qgemm.cpp);
//   q8_embedding      rows of such an int8 weight by token id (a tied embedding);
//   decoder_layer_    a whole decode layer from those and torch's matmuls (step/decoder_layer.cpp),
//                     and DecoderStack: every layer of a model in one call per step;
//   argmax_rows       greedy sampling's argmax over float32 logits rows (sampling/sampling.cpp).
//
// The ops are registered for the CPU dispatch key (decoder_layer_ also for MkldnnCPU, where
// oneDNN-packed weights send it); the tests hold each one to its torch twin
// (tests/kernels/test_cpu_ops.py).
//
// This file registers the ops (the torch bindings); the kernel bodies live by op in attention/,
// quant/, step/, sampling/ and elementwise/, each written once over the vector layer (vec/).

#include <torch/library.h>

#include <string>

#include "ops.h"

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, "
        "float v_scale) -> ()");
  m.def("varlen_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, float v_scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, float k_scale, float v_scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("decoder_layer_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor norm1, Tensor norm2, float eps, int[] kinds, int[] params, Tensor?[] linears, "
        "int[] heads, float scale, int sliding_window, float k_scale, float v_scale, "
        "Tensor? query_start_loc=None) -> ()");
  m.def("q4_linear(Tensor x, Tensor qweight, Tensor scale_mins, int path=0) -> Tensor");
  m.def("u5_linear(Tensor x, Tensor qweight, Tensor scale_mins, int path=0) -> Tensor");
  m.def("u8_linear(Tensor x, Tensor qweight, Tensor scale_mins, int path=0) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scales, int path=0) -> Tensor");
  m.def("q8_embedding(Tensor ids, Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.class_<kvserve::DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_layer", &kvserve::DecoderStack::add_layer)
      .def("forward", &kvserve::DecoderStack::forward)
      .def("size", &kvserve::DecoderStack::size)
      .def("set_team", &kvserve::DecoderStack::set_team)
      .def("team_steps", &kvserve::DecoderStack::team_steps)
      .def("set_ends", &kvserve::DecoderStack::set_ends)
      .def("forward_logits", &kvserve::DecoderStack::forward_logits)
      .def("forward_argmax", &kvserve::DecoderStack::forward_argmax);
  m.def("int8_dot_available() -> bool", &kvserve::int8_dot_available);
  m.def("vector_isa() -> str", [] { return std::string(kvserve::vector_isa()); });
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("decode_attention", &kvserve::decode_attention);
  m.impl("varlen_attention", &kvserve::varlen_attention);
  m.impl("write_kv", &kvserve::write_kv);
  m.impl("rms_norm", &kvserve::rms_norm);
  m.impl("add_rms_norm_", &kvserve::add_rms_norm_);
  m.impl("silu_and_mul", &kvserve::silu_and_mul);
  m.impl("rotary_", &kvserve::rotary_);
  m.impl("decoder_layer_", &kvserve::decoder_layer_);
  m.impl("q4_linear", &kvserve::q4_linear);
  m.impl("u5_linear", &kvserve::u5_linear);
  m.impl("u8_linear", &kvserve::u8_linear);
  m.impl("q8_linear", &kvserve::q8_linear);
  m.impl("q8_embedding", &kvserve::q8_embedding);
  m.impl("argmax_rows", &kvserve::argmax_rows);
}

// A layer whose weights oneDNN packed holds MkldnnCPU tensors: the call dispatches there.
TORCH_LIBRARY_IMPL(kvserve_cpu, MkldnnCPU, m) {
  m.impl("decoder_layer_", &kvserve::decoder_layer_);
}

