"""Attention ops over the paged KV cache, and nothing else: metadata.py (the batch layout and
backend interface every kernel shares), torch_attention.py (the torch twins: the CPU path and
the test oracle), triton_attention.py (the CUDA kernels), selector.py (picks one per device).
Nothing here imports engine/, server/ or tests/."""
