# The runtime image of the driver and trainer pods (and of the reference engine): `pip install
# .[runtime,p2p]` on a CUDA PyTorch base. The operator starts `lockstep driver --config ...` and
# `torchrun -m lockstep trainer --config ...` in it (lockstep_operator.resources.commands).
# Build from the repository root:
#   docker build -f images/runtime.Dockerfile -t ghcr.io/lockstep/lockstep-runtime:0.1.0 .
# On GB300 (arm64) build with --platform linux/arm64 from a base that ships arm64 wheels.
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
# torch comes from the base image; pip keeps it when it satisfies `torch>=2.5`.
RUN pip install --no-cache-dir ".[runtime,p2p]" && rm -rf /src \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep
USER 1000:1000
WORKDIR /home/lockstep
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["lockstep", "--help"]
