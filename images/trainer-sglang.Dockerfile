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
# SGLANG_TAG is the engine image's (checked against the pin by operator/tests/test_images.py); lockstep
# goes in through the one install step of every image (install.sh `onbase`: SGLang's torch, triton and
# transformers stay, constraints.txt supplies the rest).
#   docker build -f images/trainer-sglang.Dockerfile --build-arg FA3_REF=<commit> \
#     -t ghcr.io/lockstep/lockstep-trainer-sglang:$(python -c 'import lockstep; print(lockstep.__version__)') .
ARG SGLANG_TAG=v0.5.23
FROM lmsysorg/sglang:${SGLANG_TAG}
ARG FA3_REF
RUN test -n "${FA3_REF}" || (echo "set --build-arg FA3_REF (see the header)" && exit 1)
RUN git clone https://github.com/sgl-project/sgl-attn /tmp/flash-attention \
    && cd /tmp/flash-attention && git checkout "${FA3_REF}" && cd hopper \
    && MAX_JOBS=8 pip install --no-cache-dir --no-build-isolation . \
    && rm -rf /tmp/flash-attention
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY images/install.sh ./images/
COPY runtime ./runtime
COPY operator ./operator
RUN PIP="python3 -m pip" sh images/install.sh onbase runtime,p2p && rm -rf /src \
    && (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin lockstep)
USER 1000:1000
WORKDIR /home/lockstep
ENV PYTHONUNBUFFERED=1 SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM=0
ENTRYPOINT []
CMD ["lockstep", "--help"]
