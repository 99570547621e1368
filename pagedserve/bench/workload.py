"""The seeded benchmark workloads (`mixed`, `random`): same lengths and token ids for the same seed
as the project's shared workload definition, so figures from different runs are of the same work."""
from dataclasses import dataclass

import numpy as np

# Prompt token ids are drawn from [100, VOCAB) unless a model's vocabulary is smaller.
VOCAB = 32000


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def mixed(n: int = 512, in_lo: int = 128, in_hi: int = 1024, out_lo: int = 64, out_hi: int = 512,
          seed: int = 0, vocab: int = VOCAB) -> Workload:
    """n requests, prompt length ~U[in_lo, in_hi], output length ~U[out_lo, out_hi]."""
    rs = np.random.RandomState(seed)
    ins = rs.randint(in_lo, in_hi + 1, size=n)
    outs = rs.randint(out_lo, out_hi + 1, size=n)
    prompts = [rs.randint(100, vocab, size=int(length)).tolist() for length in ins]
    return Workload(prompts, [int(o) for o in outs])


def random(n: int = 512, input_len: int = 1024, output_len: int = 1024, seed: int = 0,
           vocab: int = VOCAB) -> Workload:
    """n requests of fixed prompt and output lengths, random token ids."""
    rs = np.random.RandomState(seed)
    prompts = [rs.randint(100, vocab, size=input_len).tolist() for _ in range(n)]
    return Workload(prompts, [output_len] * n)
