"""The Megatron-Core trainer (Megatron-Core 0.16; Transformer Engine on GPUs, the local layer spec on CPU)."""
