"""Methods fp8rl adds to vLLM's GPU workers (``LLM(worker_extension_cls=...)``, vLLM 0.32).

vLLM mixes this class into its worker class, in the processes vLLM starts; the generator calls
the methods on every worker with ``llm.collective_rpc(name, args=...)``. Names carry an
``fp8rl_`` prefix: vLLM refuses an extension method that shadows one of the worker's own.

Each worker joins the weight channel (:mod:`workers.engines.weight_channel`) as its own rank
(``first_rank`` of its generator plus its rank inside the generator's tensor-parallel group),
receives the whole payload, and loads it as checkpoint-format tensors through the worker's
``reload_weights(is_checkpoint_format=True)``: vLLM's layerwise reload shards each tensor for its
rank, re-runs the FP8 post-load processing and copies the result into the tensors CUDA graphs
captured. FP8 weights stay the trainer's bytes (``weight`` + ``weight_scale_inv``).
"""

from __future__ import annotations

from typing import Any

from workers.fp8.hf_checkpoint import checkpoint_tensors


class WeightChannelExtension:
    """Mixed into vLLM's worker: ``self.rank``, ``self.device`` and ``self.reload_weights`` are
    the worker's own. Every attribute defined here must be new to vLLM's worker (vLLM asserts it)."""

    rank: int  # annotations only: no class attribute that could clash with the worker's
    device: Any
    _fp8rl_channel: Any = None

    def fp8rl_join_channel(self, address: str, first_rank: int, world_size: int) -> None:
        from workers.engines.weight_channel import StatelessNcclWeightSync

        channel = StatelessNcclWeightSync(address, first_rank + self.rank, world_size, self.device)
        channel.init_communicator()
        self._fp8rl_channel = channel

    def fp8rl_receive_weights(self) -> dict[str, float]:
        if self._fp8rl_channel is None:
            raise RuntimeError("fp8rl_receive_weights: call fp8rl_join_channel first")
        result = self._fp8rl_channel.sync_weights(None)
        tensors = checkpoint_tensors(result.payload)
        result.payload = None
        self.fp8rl_load_tensors(tensors)
        return {
            "version": result.version,
            "bytes": result.bytes,
            "seconds": result.seconds,
            "buckets": result.buckets,
        }

    def fp8rl_load_tensors(self, tensors: dict[str, Any]) -> None:
        """Load checkpoint-format tensors (``{name: tensor}``, full, unsharded) into the model:
        the channel's last step, and a direct route for one-GPU tests (NCCL cannot pair a
        trainer and a worker on one GPU)."""
        reload = self.reload_weights  # type: ignore[attr-defined]  # vLLM's Worker.reload_weights
        reload(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)
