"""Weights from the trainer to the generators after every update, in one package:

- :mod:`~workers.weight_sync.payload`: a model's weights as a payload (FP8 layers as the trainer's
  own data and scales, everything else as tensors) and the inverse load;
- :mod:`~workers.weight_sync.broadcast`: the wire format (a manifest, then uint8 buckets) over any
  broadcast, and over the job's torch.distributed group (native engines);
- :mod:`~workers.weight_sync.channel`: the stateless weight channel of jobs with vLLM or
  Megatron-Core (gloo on CPU, NCCL on GPU);
- :mod:`~workers.weight_sync.contract`: the precision contract, what a generator holds checked
  against what the trainer sent, at every sync.

The data these carry between engines (``Payload``, ``SyncResult``, ``WeightReport``) is defined
with the engine protocols (:mod:`workers.engines.protocols`), which import nothing from here.
"""
