"""Benchmarks and the GPU checklist: above the runtime tiers, below the CLI.

``bench.rollout``, ``bench.step`` and ``bench.sync`` measure the data plane (``fp8rl bench rollout
| step | sync``), each printing ratios against a baseline measured in the same run;
``bench.gpu_check`` is the GPU checklist (``make gpu-check``). Imports go downward only: this
package may use ``rljob`` and ``workers``; nothing in the runtime imports it.
"""
