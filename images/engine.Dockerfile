# The production rollout engine: SGLang's own image (its CUDA kernels, torch and server) at the release
# the serving contract is pinned to (lockstep.api.profiles.SGLANG_VERSION; operator/tests/test_images.py
# checks that SGLANG_TAG below, constraints.txt's sglang and that constant agree), plus the lockstep
# package for the weight-transport receivers, installed by the one install step of every image
# (install.sh `onbase`: SGLang's versions stay, constraints.txt supplies the rest). The operator starts
# `python3 -m sglang.launch_server --model-path ... --port 30000 ...` in it. From the repo root:
#   docker build -f images/engine.Dockerfile -t ghcr.io/lockstep/lockstep-engine:$(python -c 'import lockstep; print(lockstep.__version__)') .
# For GB300 (arm64) pass the arm64 variant of the same release: --build-arg SGLANG_TAG=<tag>-arm64
# (SGLang publishes per-architecture tags), and join both into one index (docker buildx imagetools).
ARG SGLANG_TAG=v0.5.23
FROM lmsysorg/sglang:${SGLANG_TAG}
ARG SGLANG_TAG
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY images/install.sh ./images/
COPY runtime ./runtime
COPY operator ./operator
RUN PIP="python3 -m pip" sh images/install.sh onbase p2p && rm -rf /src \
    && python3 -c "import sglang, lockstep.weights; assert sglang.__version__ == '${SGLANG_TAG#v}'" \
    && (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep)
USER 1000:1000
ENV PYTHONUNBUFFERED=1
EXPOSE 30000
ENTRYPOINT []
CMD ["python3", "-m", "sglang.launch_server", "--help"]
