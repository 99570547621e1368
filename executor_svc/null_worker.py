"""A worker with no model, for measuring the control path (`pagedserve bench control-path`)
and for serving the executor's gRPC interface in tests without torch work."""
import time
from dataclasses import dataclass
from itertools import chain

from pagedserve.common.plan import ExecutorInfo, StepPlan, StepResult

VOCAB = 32000
TOKEN = 1  # what the null model samples; never EOS (0)


def null_executor_info(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 256,
                       max_num_batched_tokens: int = 8192) -> ExecutorInfo:
    return ExecutorInfo(num_blocks=num_blocks, block_size=block_size, dtype="none", device="none",
                        vocab_size=VOCAB, max_model_len=max_model_len, eos_token_ids=[0],
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


@dataclass(slots=True)
class NullState:
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int


class NullWorker:
    """Worker's interface with no model: keeps each request's state from the plan deltas, as the
    real runner does, and samples TOKEN for every request whose known tokens are all computed."""

    def __init__(self, info: ExecutorInfo) -> None:
        self.info = info
        self.requests: dict[int, NullState] = {}
        self.last_end = 0

    def describe(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> None:
        self.requests.clear()
        self.last_end = 0

    # The executor server's pipelined interface: a null step is done as soon as it is launched.
    synchronous = True

    def launch(self, plan: StepPlan) -> StepResult:
        return self.run(plan)

    def wait(self, step: StepResult) -> None:
        pass

    def collect(self, step: StepResult) -> StepResult:
        return step

    def run(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter_ns()
        idle_ns = start - self.last_end if self.last_end else 0
        requests = self.requests
        for seq_id in plan.dropped:
            del requests[seq_id]
        for r in plan.new_requests:
            requests[r.seq_id] = NullState(len(r.token_ids), r.num_computed_tokens, len(r.block_ids))
        for r in plan.continuing:
            requests[r.seq_id].num_blocks += len(r.new_block_ids)
        sampled = []
        for r in chain(plan.new_requests, plan.continuing):
            state = requests[r.seq_id]
            state.num_computed_tokens += r.num_scheduled_tokens
            if state.num_computed_tokens == state.num_tokens:
                state.num_tokens += 1
                sampled.append(r.seq_id)
        self.last_end = time.perf_counter_ns()
        return StepResult(plan.step_id, sampled, [TOKEN] * len(sampled), self.last_end - start, idle_ns)
