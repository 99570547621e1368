"""Per-request pooling options (vLLM's PoolingParams) and their wire form, pagedserve.v1.PoolingParams."""
from dataclasses import dataclass

from pagedserve.v1 import engine_pb2 as pb

TASKS = ("embed", "classify")


@dataclass(slots=True)
class PoolingParams:
    """What a pooling request returns. task: "embed" (a vector) or "classify" (one score per label).
    normalize (embed): None = the model's default; dimensions (embed): None = full size, else the
    leading `dimensions` components (Matryoshka); activation (classify): None = True, sigmoid for
    one label, softmax for more."""
    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooling task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


def pooling_to_proto(p: PoolingParams) -> pb.PoolingParams:
    return pb.PoolingParams(task=p.task, normalize=p.normalize, dimensions=p.dimensions or 0,
                            activation=p.activation)


def pooling_from_proto(m: pb.PoolingParams) -> PoolingParams:
    return PoolingParams(m.task or "embed", m.normalize if m.HasField("normalize") else None,
                         m.dimensions or None, m.activation if m.HasField("activation") else None)
