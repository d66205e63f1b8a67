"""Paged-KV gather/scatter kernels (Triton) with a torch fallback."""
