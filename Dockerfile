# One image for every pdserve role; the compose file picks the role by command.
#
#   docker build -t pdserve .                                   # CPU torch, default model fetched at build
#   docker build -t pdserve --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA (base must have python3 + venv)
#
# Without network (scripts/compose-e2e): put wheels for pdserve and all its dependencies in
# deploy/wheels/ and converted models in deploy/models/; nothing is downloaded then.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/var/cache/pdserve \
    PATH=/opt/venv/bin:$PATH \
    UCX_WARN_UNUSED_ENV_VARS=n

RUN python3 -m venv /opt/venv
COPY . /src
RUN if ls /src/deploy/wheels/pdserve-*.whl >/dev/null 2>&1; then \
        pip install --no-cache-dir --no-index --find-links /src/deploy/wheels pdserve; \
    else \
        pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" -c /src/constraints.txt /src; \
    fi
RUN mkdir -p "$PDSERVE_CACHE_DIR/models" \
    && cp -r /src/deploy/models/. "$PDSERVE_CACHE_DIR/models/" \
    && rm -rf /src \
    && pdserve model fetch

# gateway 50051, workers 50061, /metrics 9400 (see compose.yaml)
EXPOSE 50051 50061 9400
CMD ["pdserve", "gateway", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
