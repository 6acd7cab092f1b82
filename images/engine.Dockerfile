# The production rollout engine: SGLang's own image (its CUDA kernels, torch and server) plus the
# lockstep package for the weight-transport receivers. The operator starts
# `python3 -m sglang.launch_server --model-path ... --port 30000 ...` in it. Pin SGLANG to the
# version the serving contract (lockstep.serving) was checked against. Build from the repo root:
#   docker build -f images/engine.Dockerfile --build-arg SGLANG=v0.5.7-cu130-runtime \
#     -t ghcr.io/lockstep/lockstep-engine:0.1.0 .
ARG SGLANG=latest
FROM lmsysorg/sglang:${SGLANG}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
# --no-deps for torch/transformers: SGLang's image pins the versions its kernels were built for.
RUN pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir "pydantic>=2.10,<3" "pyyaml>=6" "httpx>=0.27" "safetensors>=0.4" \
       "zstandard>=0.23" "xxhash>=3.5" "mooncake-transfer-engine-non-cuda>=0.3.5" \
    && rm -rf /src \
    && (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep)
USER 1000:1000
ENV PYTHONUNBUFFERED=1
EXPOSE 30000
ENTRYPOINT []
CMD ["python3", "-m", "sglang.launch_server", "--help"]
