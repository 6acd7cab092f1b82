# The runtime image of the driver and trainer-rank pods, the reference engine and the pods' init steps
# (pull-model, convert-model): lockstep[runtime,p2p,megatron], so the default trainer backend
# (trainer.backend: megatron, megatron-core) starts in it. PyPI's torch carries its CUDA libraries
# (nvidia-* wheels) for amd64 and arm64 (GB300's Grace), so the base is plain Debian; the node's
# driver comes in through the NVIDIA container toolkit. Same recipe as every image here: Debian
# bookworm with base-packages.txt, then install.sh (versions from constraints.txt) into /opt/lockstep.
# `make images` builds the same image without Docker, for amd64 and arm64. From the repo root:
#   docker build -f images/runtime.Dockerfile -t ghcr.io/lockstep/lockstep-runtime:$(python -c 'import lockstep; print(lockstep.__version__)') .
# The operator starts `lockstep driver --config ...` and `lockstep launch -m lockstep trainer ...` in it
# (lockstep_operator.resources.commands).
FROM debian:bookworm-slim
COPY images/base-packages.txt /tmp/
RUN apt-get update && apt-get install -y --no-install-recommends $(grep -v '^#' /tmp/base-packages.txt) \
    && rm -rf /var/lib/apt/lists/* /tmp/base-packages.txt \
    && python3 -m venv /opt/lockstep \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY images/install.sh ./images/
RUN PIP=/opt/lockstep/bin/pip sh images/install.sh deps runtime,p2p,megatron /opt/lockstep
COPY runtime ./runtime
COPY operator ./operator
RUN PIP=/opt/lockstep/bin/pip sh images/install.sh package runtime,p2p,megatron /opt/lockstep && rm -rf /src
USER 1000:1000
WORKDIR /home/lockstep
ENV PATH=/opt/lockstep/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/home/lockstep
ENTRYPOINT []
CMD ["lockstep", "--help"]
