# The fp8rl control plane (FastAPI): `fp8rl serve`. CPU only.
#
#   docker build -f docker/controlplane.Dockerfile -t ghcr.io/fp8rl/controlplane:0.1.0 .
#
# The `controlplane` extra only: FastAPI, uvicorn, the Kubernetes client (--store kubernetes), no
# torch, Ray or transformers. It serves `store: kubernetes` (the chart's default: the operator
# runs each job); `store: sql` runs jobs as local drivers, which need the worker tier this image
# leaves out (docker/README.md).
#
# Two stages, the pattern of operator.Dockerfile too: `build` fills a virtualenv (every
# dependency is a wheel: no compiler), the final stage copies the virtualenv alone onto a clean
# base and runs as uid 10001 (the chart's runAsUser).

FROM python:3.12.12-slim-bookworm AS build

ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
# Only the packages the control plane imports (the CLI, the job contract and its own tier):
# tests/docker checks that they import nothing else and that the extra brings no torch, Ray or
# transformers.
COPY fp8rl fp8rl
COPY rljob rljob
COPY service service
# Not editable: the package is copied into the virtualenv and /src stays in this stage.
RUN pip install --no-cache-dir -c constraints.txt ".[controlplane]"


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
