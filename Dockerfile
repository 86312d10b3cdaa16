# vlmd on CPU. The PyTorch wheel is chosen by the builder: PyPI's default torch is a CUDA
# build; pass TORCH_INDEX (a CPU wheel index) to get the small CPU one.
#
# Two stages: the first has a C compiler and builds vlmd's wheel, whose CPU kernels are
# compiled there once per instruction-set level (setup.py); the image that serves has no
# compiler, and loads the level its host's CPU runs (vlmd/layers/cpu/library.py).
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY vlmd ./vlmd
COPY plugins ./plugins
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ./plugins/vlmd_llava ./plugins/vlmd_qwen2_vl \
        ./plugins/vlmd_whisper ./plugins/vlmd_qwen2_audio

FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLMD_CACHE_DIR=/var/cache/vlmd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC" \
 && pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
RUN useradd --system --create-home vlmd && mkdir -p /var/cache/vlmd && chown vlmd /var/cache/vlmd
USER vlmd
EXPOSE 8000
# Mount a checkpoint and pass its path, or run with no argument for the built-in tiny model.
ENTRYPOINT ["vlmd", "serve", "--host", "0.0.0.0", "--port", "8000"]
