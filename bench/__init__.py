"""Benchmarks and the GPU checklist: above the runtime tiers, below the CLI.

``bench.fp8`` (FP8 linear vs BF16 linear), ``bench.rollout``, ``bench.step`` and ``bench.sync``
measure the data plane and ``bench.api`` the control plane (``fp8rl bench fp8 | rollout | step |
sync | api``), each printing ratios or latencies measured in the same run; ``bench.gpu_check`` is
the GPU checklist (``make gpu-check``). Imports go downward only: this package may use the runtime
packages (``rljob``, ``workers``, ``service``, ``operators``); none of them imports it.
"""
