"""What fp8rl adds to vLLM's workers (``LLM(worker_extension_cls=...)``, vLLM 0.32).

vLLM imports this module in each worker process before it loads the model
(``vllm/v1/worker/worker_base.py``, ``init_worker``), so importing it registers fp8rl's
weight-transfer backend (:mod:`workers.engines.vllm.transfer`) there, in time for the worker to
build it from ``weight_transfer_config``. Weights travel through vLLM's own weight-transfer calls;
this extension only reads back, as plain data, what those calls do not return: the last update's
figures and the precision report. No method here takes a tensor: ``collective_rpc`` serialises
arguments with msgspec, which turns tensors into lists.

vLLM mixes the class into its worker class and calls its methods on every worker with
``llm.collective_rpc(name)``; names carry an ``fp8rl_`` prefix because vLLM refuses an extension
attribute that its worker already has.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from workers.weight_sync.data import WeightReport


def _register_backend() -> None:
    if importlib.util.find_spec("vllm") is None:  # the pure tests import this module without vLLM
        return
    from workers.engines.vllm.transfer import register

    register()


_register_backend()


class WeightChannelExtension:
    """Mixed into vLLM's worker, whose ``weight_transfer_engine`` (built from
    ``weight_transfer_config``) is fp8rl's backend. Every attribute defined here must be new to
    vLLM's worker (vLLM asserts it)."""

    weight_transfer_engine: Any  # an annotation only: the worker's own attribute

    def fp8rl_last_sync(self) -> dict[str, float]:
        """``{version, bytes, seconds, buckets}`` of the last update this worker received."""
        from workers.engines.vllm.transfer import worker_last_sync

        return worker_last_sync(self.weight_transfer_engine)

    def fp8rl_weight_report(self) -> WeightReport:
        """What this worker holds after the last update (:mod:`workers.weight_sync.contract`)."""
        from workers.engines.vllm.transfer import worker_report

        return worker_report(self.weight_transfer_engine)
