# The operator image: the base install of the `lockstep` distribution (pydantic, pyyaml, kopf,
# aiohttp, prometheus-client) and nothing else. No torch: the operator never imports it
# (operator/tests/test_no_torch.py). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/lockstep/lockstep-operator:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 65532 --create-home --shell /usr/sbin/nologin lockstep
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "import lockstep_operator.handlers, sys; assert 'torch' not in sys.modules"
USER 65532:65532
ENV PYTHONUNBUFFERED=1
EXPOSE 8080 9090
ENTRYPOINT []
CMD ["lockstep-operator"]
