"""Attention ops over the paged KV cache: torch twins (CPU path and test oracle)."""
