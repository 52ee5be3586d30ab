"""Moved to ``helpers.kernels.varlen``: these names stay importable from here for notebooks saved before the move."""
from .kernels.varlen import flash_attn_varlen_triton, varlen_block_m, varlen_block_map

__all__ = ["flash_attn_varlen_triton", "varlen_block_map", "varlen_block_m"]
