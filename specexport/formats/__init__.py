"""Quantized weight formats, each a loader mapping a checkpoint's tensors onto BlockQuantized
(blocks.py): GGUF blocks (gguf.py), GPTQ (gptq.py), AWQ (awq.py)."""
