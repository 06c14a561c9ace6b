# The GPU worker: the image of every pod of a job's RayCluster (KubeRay starts `ray start` in it
# as head and as workers; the head runs the driver, `python -m workers.job.driver`). CUDA PyTorch,
# vLLM (generation), Megatron-Core + Transformer Engine (training), Ray, fp8rl.
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/fp8rl/worker:0.1.0 .
#
# Needs BuildKit (the default builder of Docker 23 and later): the runtime stage mounts the
# wheels built in `build` instead of copying them into a layer.

# The version set, one place. vLLM pins torch exactly (vllm 0.32.0 requires torch==2.13.0, the
# CUDA 13.0 build on PyPI, which is also the CPU pin of constraints.txt: one torch everywhere).
# Transformer Engine 2.11.0 is the newest release inside megatron-core 0.16.1's tested range
# (its dev extra: transformer-engine[core_cu13,pytorch]>=2.9,<2.12); its PyTorch extension is a
# source distribution, compiled below against that torch and CUDA 13.0. Ray must equal
# operators/settings.py `ray_version` (the RayCluster's rayVersion, which KubeRay reads).
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG TE_VERSION=2.11.0
ARG MCORE_VERSION=0.16.1
ARG RAY_VERSION=2.60.0
# torch requires setuptools>=77.0.3, vLLM <81 on Python 3.12
ARG SETUPTOOLS_VERSION=80.9.0
ARG NINJA_VERSION=1.13.0

# ---------------------------------------------------------------------------------------------
# build: compile Transformer Engine's PyTorch extension (needs nvcc and the cuDNN headers).
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04 AS build
ARG TORCH_VERSION
ARG TE_VERSION
ARG SETUPTOOLS_VERSION
ARG NINJA_VERSION
# FP8 GPUs: Ada (8.9), Hopper (9.0), Blackwell (10.0); fewer architectures, a shorter build.
# The same list twice: Transformer Engine's spelling and torch's.
ARG CUDA_ARCHS="89;90;100"
ARG TORCH_CUDA_ARCH_LIST="8.9;9.0;10.0"
ARG MAX_JOBS=4

ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git \
    && rm -rf /var/lib/apt/lists/*

ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir \
        "torch==${TORCH_VERSION}" \
        "transformer-engine-cu13==${TE_VERSION}" \
        "setuptools==${SETUPTOOLS_VERSION}" \
        "ninja==${NINJA_VERSION}"

# --no-build-isolation: build against the torch installed above, not a fresh one
RUN NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${CUDA_ARCHS}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    MAX_JOBS="${MAX_JOBS}" pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels \
        "transformer-engine-torch==${TE_VERSION}"

# ---------------------------------------------------------------------------------------------
# runtime: CUDA user-space libraries come from the torch wheels (cuda-toolkit 13.0, cuDNN, NCCL),
# so the base is the small CUDA image that only carries the driver hooks.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS runtime
ARG TORCH_VERSION
ARG VLLM_VERSION
ARG TE_VERSION
ARG MCORE_VERSION
ARG RAY_VERSION
ARG SETUPTOOLS_VERSION

ENV DEBIAN_FRONTEND=noninteractive
# gcc/g++ and the Python headers: Triton and torch.compile compile launchers at run time (and
# reasoning-gym's pycosat builds from source); wget: KubeRay's health probes; libibverbs and its
# providers: NCCL over InfiniBand/RoCE; bubblewrap: the sandbox of `fp8rl serve`'s local drivers
# (the chart's store "sql"; service/sandbox.py), where the pod may make user namespaces.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv gcc g++ libc6-dev \
        wget ca-certificates libibverbs1 ibverbs-providers bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# Ray's images run as uid 1000 (group users, 100), and so do the operator's pods
# (runAsUser 1000, fsGroup 100). Ubuntu's own user holds uid 1000 in the base image.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
    && useradd --uid 1000 --gid 100 --create-home --shell /bin/bash ray

# One constraints file keeps each later install from moving the pinned set. KubeRay starts the
# containers with `bash -l`, whose /etc/profile resets PATH: profile.d puts the venv back.
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv \
    && echo "export PATH=/opt/venv/bin:\$PATH" > /etc/profile.d/fp8rl-venv.sh \
    && printf '%s\n' "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" \
        "transformer-engine==${TE_VERSION}" "transformer-engine-cu13==${TE_VERSION}" \
        "megatron-core==${MCORE_VERSION}" "ray==${RAY_VERSION}" \
        "setuptools==${SETUPTOOLS_VERSION}" > /opt/venv/constraints.txt \
    && pip install --no-cache-dir -c /opt/venv/constraints.txt \
        "torch==${TORCH_VERSION}" "setuptools==${SETUPTOOLS_VERSION}"

# The engines, a layer of their own (they change less often than fp8rl)
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir -c /opt/venv/constraints.txt \
        "vllm==${VLLM_VERSION}" \
        "megatron-core==${MCORE_VERSION}" \
        "transformer-engine==${TE_VERSION}" \
        "transformer-engine-cu13==${TE_VERSION}" \
        /wheels/transformer_engine_torch-${TE_VERSION}-*.whl \
        "ray[default]==${RAY_VERSION}"

# Transformer Engine compiles some kernels at run time (NVRTC) and needs the CUDA headers,
# which the base image lacks.
COPY --from=build /usr/local/cuda-13.0/targets/x86_64-linux/include /usr/local/cuda-13.0/targets/x86_64-linux/include
ENV NVTE_CUDA_INCLUDE_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/include

# fp8rl last: it changes most often. The worker tier: the driver and the engines (workers), the
# job contract (rljob), the CLI (fp8rl run/export/report) and the benchmarks with the GPU
# checklist (bench, `python -m bench.gpu_check`); not the control plane or the operator.
WORKDIR /opt/fp8rl
COPY pyproject.toml README.md ./
COPY fp8rl fp8rl
COPY rljob rljob
COPY workers workers
COPY bench bench
COPY service service
RUN pip install --no-cache-dir -c /opt/venv/constraints.txt ".[worker,controlplane]"

ENV PYTHONUNBUFFERED=1
# The job's working directory (rljob.paths.POD_HOME): the operator mounts an emptyDir there, and it
# belongs to the image's user too, so a pod run without that volume can still write where it works
RUN mkdir -p /data && chown 1000:100 /data && chmod 0775 /data
USER 1000
WORKDIR /data
# Ray: GCS, dashboard (job submission), client; the driver's Prometheus /metrics
# (operators/settings.py metrics_port)
EXPOSE 6379 8265 10001 9400
CMD ["fp8rl", "--help"]
