# The operator image: the base install of the `lockstep` distribution (pydantic, pyyaml, kopf,
# kubernetes, aiohttp, prometheus-client) and nothing else. No torch: the operator never imports it
# (operator/tests/test_no_torch.py). Same recipe as every image here: Debian bookworm with
# base-packages.txt, then install.sh (versions from constraints.txt) into /opt/lockstep. `make images`
# builds the same image without Docker, for amd64 and arm64 (images/README.md). From the repo root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/lockstep/lockstep-operator:$(python -c 'import lockstep; print(lockstep.__version__)') .
FROM debian:bookworm-slim
COPY images/base-packages.txt /tmp/
RUN apt-get update && apt-get install -y --no-install-recommends $(grep -v '^#' /tmp/base-packages.txt) \
    && rm -rf /var/lib/apt/lists/* /tmp/base-packages.txt \
    && python3 -m venv /opt/lockstep \
    && useradd --uid 65532 --create-home --shell /usr/sbin/nologin lockstep
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY images/install.sh ./images/
RUN PIP=/opt/lockstep/bin/pip sh images/install.sh deps "" /opt/lockstep
COPY runtime ./runtime
COPY operator ./operator
RUN PIP=/opt/lockstep/bin/pip sh images/install.sh package "" /opt/lockstep && rm -rf /src \
    && /opt/lockstep/bin/python -c "import lockstep_operator.handlers, sys; assert 'torch' not in sys.modules"
USER 65532:65532
WORKDIR /home/lockstep
ENV PATH=/opt/lockstep/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
EXPOSE 8080 9090
ENTRYPOINT []
CMD ["lockstep-operator"]
