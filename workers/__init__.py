"""Everything that runs inside Ray, in rooms from the bottom up:

- ``fp8`` (FP8 numerics) and ``algo`` (advantages, losses, importance sampling, mismatch);
- ``weight_sync`` (trainer-to-generator weights and their contract);
- ``engines`` (native, vLLM, Megatron-Core generators and trainers);
- ``models`` (fetch, tokenizer, export, checkpoints); ``tasks`` (problems and graders);
- ``rl`` (one step and the loop, without Ray); ``job`` (the driver and its Ray actors).

A room imports only the rooms listed before it (tests/test_architecture.py holds it).

No HTTP and no Kubernetes here; vLLM, Megatron-Core and Transformer Engine adapters are imported
lazily so that ``import workers`` needs neither a GPU nor those packages.
"""
