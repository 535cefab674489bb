"""Hot-path operations. Each has a pure-torch reference (also the CPU path) and, in cuda/,
a CUDA kernel of the same name that is held to the same tests."""

from kvmemory.ops.gather_blocks import gather_blocks, gather_blocks_ref
from kvmemory.ops.window_attention import plain_attention, use_window_attention, window_attention, window_attention_ref

__all__ = ["gather_blocks", "gather_blocks_ref", "plain_attention", "use_window_attention", "window_attention", "window_attention_ref"]
