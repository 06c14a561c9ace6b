# The fp8rl operator (kopf): `fp8rl operator`, which turns RLJobs into KubeRay RayJobs. CPU only.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/fp8rl/operator:0.1.0 .
#
# The `operator` extra only: kopf and the Kubernetes client, no torch, Ray or transformers.
#
# The same two stages as controlplane.Dockerfile (kept standalone so that each file builds on
# its own): `build` fills a virtualenv, the final stage copies it onto a clean base and runs as
# uid 10001 (the chart's runAsUser).

FROM python:3.12.12-slim-bookworm AS build

ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
# Only the packages the operator imports (the CLI, the job contract and its own tier):
# tests/docker checks that they import nothing else and that the extra brings no torch, Ray or
# transformers.
COPY fp8rl fp8rl
COPY rljob rljob
COPY operators operators
# Not editable: the package is copied into the virtualenv and /src stays in this stage.
RUN pip install --no-cache-dir -c constraints.txt ".[operator]"


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
