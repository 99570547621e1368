"""A fake executor for the scheduler's randomized tests: it keeps per-seq state from plan deltas
and a KV cache of token ids, and its model is a pure function of the sequence."""
from collections import Counter
from dataclasses import dataclass

from pagedserve.common.plan import StepPlan, StepResult
from pagedserve.scheduler_svc.block_manager import NULL_BLOCK

VOCAB = 32


def next_token(token_ids: list[int]) -> int:
    """The fake model: a pure function of the whole sequence, like greedy decoding."""
    return hash(tuple(token_ids)) % VOCAB


@dataclass
class SeqState:
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


class FakeExecutor:
    """Keeps per-seq state from plan deltas as the real executor does, and a KV cache whose slots
    hold the token computed there: sampling reads the sequence back through the block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, SeqState] = {}

    def read(self, seq: SeqState, end: int) -> list[int | None]:
        bs = self.block_size
        return [self.kv[seq.block_ids[p // bs]][p % bs] for p in range(end)]

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for seq_id in plan.dropped:
            assert seq_id in self.seqs, f"dropped unknown seq {seq_id}"
            del self.seqs[seq_id]
        work = []
        for r in plan.new_requests:
            assert r.seq_id not in self.seqs, f"seq {r.seq_id} sent twice"
            self.seqs[r.seq_id] = SeqState(list(r.token_ids), r.num_computed_tokens, list(r.block_ids))
            work.append((r.seq_id, r.num_scheduled_tokens))
        for r in plan.continuing:
            assert r.seq_id in self.seqs, f"continuing unknown seq {r.seq_id}"
            self.seqs[r.seq_id].block_ids += r.new_block_ids
            work.append((r.seq_id, r.num_scheduled_tokens))
        # Like the model: every scheduled token's KV is written before any attention reads the
        # cache, so a prefix hit on a block another request fills in this same step is valid.
        for seq_id, n in work:
            seq = self.seqs[seq_id]
            end = seq.num_computed + n
            assert n > 0 and end <= len(seq.token_ids)
            assert len(seq.block_ids) == -(-end // bs), "blocks must cover exactly the scheduled tokens"
            for p in range(seq.num_computed, end):
                self.kv[seq.block_ids[p // bs]][p % bs] = seq.token_ids[p]
        for r in plan.new_requests:
            seq = self.seqs[r.seq_id]
            assert self.read(seq, seq.num_computed) == seq.token_ids[:seq.num_computed], "bad cache hit"
        for seq_id, n in work:
            self.seqs[seq_id].num_computed += n
        holders = Counter(b for seq in self.seqs.values() for b in seq.block_ids)
        assert NULL_BLOCK not in holders
        for seq in self.seqs.values():
            for i, b in enumerate(seq.block_ids):
                # A block may be shared only through the prefix cache: full of computed tokens.
                assert holders[b] == 1 or (i + 1) * bs <= seq.num_computed, f"block {b} shared"
        result = StepResult(plan.step_id)
        for seq_id, _ in work:
            seq = self.seqs[seq_id]
            end = seq.num_computed
            if end == len(seq.token_ids):
                token = next_token(self.read(seq, end))
                seq.token_ids.append(token)
                result.seq_ids.append(seq_id)
                result.token_ids.append(token)
        return result
