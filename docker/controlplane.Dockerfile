# The fp8rl control plane (FastAPI): `fp8rl serve`. CPU only.
#
#   docker build -f docker/controlplane.Dockerfile -t ghcr.io/fp8rl/controlplane:0.1.0 .
#
# Two stages, the pattern of operator.Dockerfile too: `build` has a C compiler (reasoning-gym
# pins pycosat, which PyPI ships as source only) and fills a virtualenv; the final stage copies
# the virtualenv alone onto a clean base and runs as uid 10001 (the chart's runAsUser).

FROM python:3.12.12-slim-bookworm AS build

# torch is a dependency of the fp8rl distribution; the control plane never runs a model, so it
# gets the CPU build (PyPI's Linux torch is the multi-GB CUDA one). Same version as constraints.txt.
ARG TORCH_VERSION=2.13.0

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu"

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY fp8rl fp8rl
COPY rljob rljob
COPY workers workers
COPY service service
COPY operators operators
COPY bench bench
# Not editable: the package is copied into the virtualenv and /src stays in this stage.
RUN pip install --no-cache-dir -c constraints.txt .


FROM python:3.12.12-slim-bookworm

RUN groupadd --gid 10001 fp8rl \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/fp8rl --no-create-home --shell /usr/sbin/nologin fp8rl \
    && install -d -o 10001 -g 10001 /var/lib/fp8rl

COPY --from=build /opt/venv /opt/venv

# Listen on all interfaces (the settings' default is loopback); the SQLite store and the run
# directories go under FP8RL_DATA_DIR, a volume in the chart (`--store kubernetes` writes nothing).
# FP8RL_TOKENS_FILE must name the {token: tenant} file: the chart mounts it from a Secret.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    FP8RL_HOST=0.0.0.0 \
    FP8RL_PORT=8000 \
    FP8RL_DATA_DIR=/var/lib/fp8rl

USER 10001:10001
WORKDIR /var/lib/fp8rl
EXPOSE 8000
ENTRYPOINT ["fp8rl"]
CMD ["serve"]
