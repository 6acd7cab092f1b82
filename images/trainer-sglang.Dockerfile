# The trainer image for true on-policy against SGLang engines (trainer kernels `sglang`,
# lockstep.numerics.sglang_kernels): the FSDP trainer enables SGLang's own batch-invariant ops and runs
# FlashAttention-3, so it needs the engine's SGLang (same release as the engine image: the pin in
# lockstep.api.profiles.SGLANG_VERSION) with its dependencies, plus FlashAttention-3's
# `flash_attn_interface` (transformers' `flash_attention_3`), which SGLang's image does not carry.
# FA3 is built from source (Hopper, sm_90a; needs the CUDA toolkit of SGLang's non-runtime image, and
# an hour) from sgl-project/sgl-attn, the flash-attention fork sgl-kernel (the engine's attention)
# builds its FA3 from. FA3_REF must be given: the commit sgl-kernel's CMakeLists.txt pins for
# `repo-flash-attention` in the sgl-kernel release of the pinned SGLang, so both sides compile one
# kernel source. Not built or run in this
# repository's CI (no Hopper GPU with this toolchain there); docs/true-on-policy.md says what is and
# is not verified.
#   docker build -f images/trainer-sglang.Dockerfile --build-arg SGLANG=v0.5.23-cu129 \
#     --build-arg FA3_REF=<commit> -t ghcr.io/lockstep/lockstep-trainer-sglang:0.1.0 .
ARG SGLANG=latest
FROM lmsysorg/sglang:${SGLANG}
ARG FA3_REF
RUN test -n "${FA3_REF}" || (echo "set --build-arg FA3_REF (see the header)" && exit 1)
RUN git clone https://github.com/sgl-project/sgl-attn /tmp/flash-attention \
    && cd /tmp/flash-attention && git checkout "${FA3_REF}" && cd hopper \
    && MAX_JOBS=8 pip install --no-cache-dir --no-build-isolation . \
    && rm -rf /tmp/flash-attention
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
# --no-deps for torch/transformers/triton: SGLang's image pins what its kernels were built for, and
# the trainer must run that SGLang's ops on that torch and triton.
RUN pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir "pydantic>=2.10,<3" "pyyaml>=6" "httpx>=0.27" "safetensors>=0.4" \
       "zstandard>=0.23" "xxhash>=3.5" "blake3>=1.0" "tqdm>=4.66" "matplotlib>=3.9" "openai>=1.50" \
       "datasets>=3" "mooncake-transfer-engine-non-cuda>=0.3.5" \
    && rm -rf /src \
    && (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep)
USER 1000:1000
WORKDIR /home/lockstep
ENV PYTHONUNBUFFERED=1 SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM=0
ENTRYPOINT []
CMD ["lockstep", "--help"]
