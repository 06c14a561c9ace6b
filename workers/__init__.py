"""Everything that runs inside Ray: FP8 numerics, RL algorithms, engines, the driver loop.

No HTTP and no Kubernetes here; vLLM, Megatron-Core and Transformer Engine adapters are imported
lazily so that ``import workers`` needs neither a GPU nor those packages.
"""
