# The fp8rl operator (kopf): `fp8rl operator`, which turns RLJobs into KubeRay RayJobs. CPU only.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/fp8rl/operator:0.1.0 .
#
# The same two stages as controlplane.Dockerfile (kept standalone so that each file builds on
# its own): `build` fills a virtualenv with a C compiler at hand, the final stage copies it onto
# a clean base and runs as uid 10001 (the chart's runAsUser).

FROM python:3.12.12-slim-bookworm AS build

# torch is a dependency of the fp8rl distribution; the operator never runs a model, so it gets
# the CPU build (PyPI's Linux torch is the multi-GB CUDA one). Same version as constraints.txt.
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
RUN pip install --no-cache-dir -c constraints.txt .


FROM python:3.12.12-slim-bookworm

RUN groupadd --gid 10001 fp8rl \
    && useradd --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin fp8rl

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

USER 10001:10001
# kopf's liveness endpoint (the chart's livenessProbe); KUBECONFIG or the in-cluster config
EXPOSE 8080
ENTRYPOINT ["fp8rl"]
CMD ["operator", "--liveness", "http://0.0.0.0:8080/healthz"]
