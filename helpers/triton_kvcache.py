"""Moved to ``helpers.kernels.kvcache``: this name stays importable from here for notebooks saved before the move."""
from .kernels.kvcache import flash_attn_with_kvcache_triton

__all__ = ["flash_attn_with_kvcache_triton"]
