"""Benchmarks and the GPU checklist: above the runtime tiers, below the CLI.

``bench.fp8`` (FP8 linear vs BF16 linear), ``bench.rollout``, ``bench.step`` and ``bench.sync``
measure the data plane, ``bench.api`` the control plane and ``bench.operator`` the operator
(``fp8rl bench fp8 | rollout | step | sync | api | operator``), each printing ratios or latencies
measured in the same run; ``bench.mismatch`` and ``bench.gradients`` measure FP8 numerics
(``fp8rl bench mismatch | gradients``); ``bench.gpu_check`` is the GPU checklist (``make
gpu-check``); ``bench.kube_emulator`` is kmock as a local Kubernetes API, for ``bench.operator``
and the tests. Imports go downward only: this package may use the runtime packages (``rljob``,
``workers``, ``service``, ``operators``); none of them imports it.
"""
