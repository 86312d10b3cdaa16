# vlmd's CPU image:   docker build -t vlmd .
#                     docker run --rm -p 8000:8000 vlmd            (the built-in tiny model)
#                     docker run --rm -p 8000:8000 -v /srv/models/m:/model:ro vlmd /model
#
# torch comes from PyTorch's CPU wheel index by default (PyPI's default torch is a CUDA build,
# several GB). For a CUDA image pass that build's index, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t vlmd:cu128 .
# (an empty TORCH_INDEX means pip's own index). Every Python package's version, torch's
# included, is the one in constraints.txt, the file CI installs through too.
#
# Two stages: the first has a C compiler and builds the wheels, with vlmd's CPU kernels
# compiled once per instruction-set level (setup.py); the image that serves has no compiler
# and loads the level its host's CPU runs (vlmd/layers/cpu/library.py). Layers go from what
# changes least to what changes most, so an edit to vlmd's Python code rebuilds only the
# last two steps of each stage (the wheels, and installing them: seconds); torch, the
# dependencies and the compiled kernels come from the cache.
#
# The base is a build argument so a deployment can pin it by digest:
#   --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The pinned versions, and the build tools at theirs.
COPY constraints.txt ./
RUN pip install -c constraints.txt setuptools wheel
# The kernels, from their own sources only (no Python module but the variants table): an
# edit elsewhere reuses this layer.
COPY setup.py ./
COPY vlmd/layers/cpu/*.c vlmd/layers/cpu/*.h vlmd/layers/cpu/variants.py ./vlmd/layers/cpu/
RUN python setup.py -q build_ext
# The lists the final stage installs: torch's pin alone, then vlmd's dependencies. Copied
# from here by content, so a pyproject.toml edit that leaves the dependencies as they were
# does not reinstall them.
COPY pyproject.toml ./
RUN mkdir /deps && cp constraints.txt /deps/ && grep -E '^torch==' constraints.txt > /deps/torch.txt \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /deps/requirements.txt
# The source, last. The kernels built above are newer than their sources (touch), so the
# wheel build packs them instead of compiling them again.
COPY MANIFEST.in README.md ./
COPY vlmd ./vlmd
COPY plugins ./plugins
RUN find build -name '*.so' -exec touch {} + \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . plugins/*/

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1 VLMD_CACHE_DIR=/var/cache/vlmd HOME=/home/vlmd
# tini as PID 1: it passes SIGTERM on to vlmd and reaps children, so `docker stop` ends the
# server at once, even while it loads a model (a PID 1 ignores a signal it has no handler
# for). The user: a fixed non-root UID in the root group, and the home and cache directories
# group-owned by root with the group's permissions equal to the owner's, so the image also
# runs as any other UID in group 0 (`docker run --user 12345:0`, OpenShift's random UIDs).
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --gid 0 --home-dir /home/vlmd --create-home --shell /usr/sbin/nologin vlmd \
 && mkdir -p /var/cache/vlmd \
 && chown 10001:0 /home/vlmd /var/cache/vlmd && chmod 2775 /home/vlmd /var/cache/vlmd
# torch alone (the biggest layer, ~0.7 GB for the CPU build), then the rest from the default index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY --from=build /deps/torch.txt /deps/
RUN pip install --no-deps ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} -r /deps/torch.txt
COPY --from=build /deps/requirements.txt /deps/constraints.txt /deps/
RUN pip install -r /deps/requirements.txt -c /deps/constraints.txt
COPY --from=build /wheels /wheels
RUN pip install -c /deps/constraints.txt /wheels/*.whl && rm -rf /wheels && pip check
# Declared after every step that writes into it (a build discards later writes to a volume).
# The embedded tiny model is built there on first start; keep it in a named volume to build it once.
VOLUME ["/var/cache/vlmd"]
USER 10001:0
EXPOSE 8000
# Nothing but the image's own Python: healthy once /health answers 200 (it answers 503 while
# the model loads and after a fatal engine failure), on the port of the server's command line (a `--port N` given to
# `docker run` wins over the entrypoint's 8000). The start period covers loading a large checkpoint.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; a = open('/proc/1/cmdline').read().split(chr(0)); p = [a[i + 1] if x == '--port' else x[7:] for i, x in enumerate(a) if x == '--port' or x.startswith('--port=')]; urllib.request.urlopen(f'http://127.0.0.1:{p[-1] if p else 8000}/health', timeout=8)"]
# Mount a checkpoint and pass its path, or run with no argument for the built-in tiny model;
# further `vlmd serve` flags follow (`vlmd serve --help`).
ENTRYPOINT ["/usr/bin/tini", "--", "vlmd", "serve", "--host", "0.0.0.0", "--port", "8000"]
