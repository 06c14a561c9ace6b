"""Benchmarks and the GPU checklist: above the runtime tiers, below the CLI.

``bench.rollout``, ``bench.step`` and ``bench.sync`` measure the data plane (``fp8rl bench rollout
| step | sync``), each printing ratios against a baseline measured in the same run;
``bench.gpu_check`` is the GPU checklist (``make gpu-check``); ``bench.operator`` times the
operator (``fp8rl bench operator``) on ``bench.kube_emulator``, kmock as a local Kubernetes API
that the tests use too. Imports go downward only: this package may use ``rljob``, ``workers``,
``service`` and ``operators``; nothing in the runtime imports it.
"""
