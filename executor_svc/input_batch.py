"""The persistent batch: every running request's tokens, block table and sampling options as rows
of preallocated numpy arrays, so that a step is built by vectorised indexing rather than per-request
Python work (vLLM's InputBatch)."""
import numpy as np
import torch

from pagedserve.common.plan import NewRequest
from pagedserve.executor_svc.logits import AllowedTokensTable, LogitBiasTable

FREE_ROW = np.iinfo(np.int64).min


class InputBatch:
    """Rows of per-request state, one row per running request, reused after a request leaves.

    Block-table changes are also queued as (row, column, block id) triples so the device copy of
    the table can be updated incrementally (`take_block_updates`)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.rows: dict[int, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Row -> seq_id (FREE_ROW when unused): tells a launched step's late tokens whether their
        # request still holds the row.
        self.seq_ids = np.full(max_num_seqs, FREE_ROW, dtype=np.int64)
        # One column past max_model_len: the token sampled at the last position lands there.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int64)
        self.temperature = np.ones(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        # token_ids[row, :num_prompt[row]] is the prompt, the rest outputs.
        self.num_prompt = np.zeros(max_num_seqs, dtype=np.int64)
        self.repetition = np.ones(max_num_seqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence = np.zeros(max_num_seqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)  # -1: none asked
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        # 0 unless the row has stop ids to mask until min_tokens (held in stop_ids).
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        # The rows that use each feature, so that a batch where none does skips it without a look.
        self.stop_ids: dict[int, np.ndarray] = {}
        # A row's bad words (token id sequences), and the most of its last outputs one can end with:
        # the last id of one is masked where the outputs end with its others.
        self.bad_words: dict[int, tuple[list[list[int]], int]] = {}
        self.penalised: set[int] = set()
        self.logprob_rows: set[int] = set()
        self.prompt_logprob_rows: set[int] = set()
        self.logit_bias = LogitBiasTable(max_num_seqs, vocab_size, device)
        self.allowed = AllowedTokensTable(max_num_seqs, vocab_size, device)
        self._update_rows: list[int] = []
        self._update_cols: list[int] = []
        self._update_ids: list[int] = []

    def row(self, seq_id: int) -> int:
        row = self.rows.get(seq_id)
        if row is None:
            raise self.unknown(seq_id)
        return row

    @staticmethod
    def unknown(seq_id: int) -> ValueError:
        return ValueError(f"step plan names seq_id {seq_id}, which this executor does not hold; "
                          "the scheduler and executor are out of step (restart the scheduler)")

    def add(self, request: NewRequest) -> int:
        if not self.free_rows:
            raise ValueError(f"step plan adds a request past the executor's max_num_seqs "
                             f"({self.max_num_seqs}); start the executor with the scheduler's "
                             "--max-num-seqs")
        if request.seq_id in self.rows:
            raise ValueError(f"step plan adds seq_id {request.seq_id}, which is already running")
        row = self.free_rows.pop()
        self.rows[request.seq_id] = row
        self.seq_ids[row] = request.seq_id
        n = len(request.token_ids)
        self.token_ids[row, :n] = request.token_ids
        # Behind the scheduler's check, as a second guard: an id outside the vocabulary would index
        # past the embedding (on a GPU, a device assert that ends every request).
        np.clip(self.token_ids[row, :n], 0, self.vocab_size - 1, out=self.token_ids[row, :n])
        self.num_tokens[row] = n
        self.num_computed[row] = request.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, request.block_ids)
        s = request.sampling
        self.temperature[row], self.top_p[row] = s.temperature, s.top_p
        self.top_k[row], self.min_p[row] = s.top_k, s.min_p
        if s.seed is not None:
            self.generators[row] = torch.Generator(device=self.device).manual_seed(s.seed)
        self.num_prompt[row] = n if request.num_prompt_tokens is None else request.num_prompt_tokens
        self._add_logits_options(row, request)
        return row

    def _add_logits_options(self, row: int, request: NewRequest) -> None:
        s = request.sampling
        self.repetition[row], self.frequency[row] = s.repetition_penalty, s.frequency_penalty
        self.presence[row] = s.presence_penalty
        if s.repetition_penalty != 1 or s.frequency_penalty or s.presence_penalty:
            self.penalised.add(row)
        self.num_logprobs[row] = -1 if s.logprobs is None else s.logprobs
        if s.logprobs is not None:
            self.logprob_rows.add(row)
        # After a preemption (outputs known) the scheduler has had the prompt's logprobs already.
        asks = s.prompt_logprobs is not None and self.num_prompt[row] == len(request.token_ids)
        self.num_prompt_logprobs[row] = s.prompt_logprobs if asks else -1
        if asks:
            self.prompt_logprob_rows.add(row)
        if s.logit_bias:
            self.logit_bias.set(row, s.logit_bias)
        if s.allowed_token_ids:
            self.allowed.set(row, s.allowed_token_ids)
        if s.bad_words_token_ids:
            # Masked in the flat logits too: a word with an id past the vocabulary is dropped.
            vocab = self.vocab_size
            words = [w for w in s.bad_words_token_ids if all(0 <= t < vocab for t in w)]
            if words:
                self.bad_words[row] = words, max(map(len, words)) - 1
        self.min_tokens[row] = 0
        if s.min_tokens and request.min_tokens_mask_ids:
            self.min_tokens[row] = s.min_tokens
            stop_ids = np.array(request.min_tokens_mask_ids, dtype=np.int64)
            # Masked in the flat logits, where an id past the vocabulary is another row's token.
            self.stop_ids[row] = stop_ids[(stop_ids >= 0) & (stop_ids < self.vocab_size)]

    def remove(self, seq_id: int) -> None:
        row = self.row(seq_id)
        del self.rows[seq_id]
        self.seq_ids[row] = FREE_ROW
        self.generators.pop(row, None)
        self.stop_ids.pop(row, None)
        self.bad_words.pop(row, None)
        self.penalised.discard(row)
        self.logprob_rows.discard(row)
        self.prompt_logprob_rows.discard(row)
        self.logit_bias.clear(row)
        self.allowed.clear(row)
        self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks:
            raise ValueError(f"step plan gives a request {end} blocks, more than max_model_len "
                             f"needs ({self.max_blocks})")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end
        self._update_rows += [row] * len(block_ids)
        self._update_cols += range(start, end)
        self._update_ids += block_ids

    def take_block_updates(self) -> np.ndarray | None:
        """[3, n] (rows, columns, block ids) of the table entries set since the last call."""
        if not self._update_ids:
            return None
        updates = np.array((self._update_rows, self._update_cols, self._update_ids), dtype=np.int64)
        self._update_rows.clear()
        self._update_cols.clear()
        self._update_ids.clear()
        return updates

    def token_mask(self, rows: np.ndarray) -> np.ndarray | None:
        """[2, n] (index into rows, token id): the tokens the rows may not sample this step, their
        stop ids before min_tokens and their bad words' last ids; None if there are none."""
        masks = [self.stop_mask(rows) if self.stop_ids else None, self.banned(rows) if self.bad_words else None]
        masks = [m for m in masks if m is not None]
        return np.concatenate(masks, axis=1) if masks else None

    def banned(self, rows: np.ndarray) -> np.ndarray | None:
        """[2, n] (index into rows, token id): the last id of each bad word whose other ids end the
        row's outputs (all of a one-token word); None if none does."""
        pairs = []
        for i, row in enumerate(rows.tolist()):
            if row not in self.bad_words:
                continue
            words, span = self.bad_words[row]
            end = int(self.num_tokens[row])
            start = max(int(self.num_prompt[row]), end - span)
            outputs = self.token_ids[row, start:end].tolist()
            for word in words:
                k = len(word) - 1
                if k <= len(outputs) and outputs[len(outputs) - k:] == word[:-1]:
                    pairs.append((i, word[-1]))
        return np.array(pairs, dtype=np.int64).T if pairs else None

    def stop_mask(self, rows: np.ndarray) -> np.ndarray | None:
        """[2, n] (index into rows, token id): the stop ids of the rows that have fewer than
        min_tokens outputs; None if no row does."""
        short = np.flatnonzero(self.num_tokens[rows] - self.num_prompt[rows] < self.min_tokens[rows])
        if not len(short):
            return None
        ids = [self.stop_ids[row] for row in rows[short].tolist()]
        return np.stack((np.repeat(short, [len(i) for i in ids]), np.concatenate(ids)))

    def prompt_positions(self, rows: np.ndarray, query_lens: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """For a step computing query_lens tokens of each row from its num_computed on: the
        indices into rows that asked for prompt logprobs and compute positions that predict a
        prompt token, each one's first such position and count, the step's token index of every
        such position, and the prompt token it predicts. None when there are none."""
        computed = self.num_computed[rows]
        ends = np.minimum(computed + query_lens, self.num_prompt[rows] - 1)
        index = np.flatnonzero((self.num_prompt_logprobs[rows] >= 0) & (ends > computed))
        if not len(index):
            return None
        offsets = np.cumsum(query_lens) - query_lens
        starts, counts = computed[index], ends[index] - computed[index]
        first = np.repeat(offsets[index] - starts, counts)
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts.tolist(), counts.tolist())])
        targets = self.token_ids[np.repeat(rows[index], counts), positions + 1]
        return index, starts, counts, first + positions, targets

    def padded_tokens(self, rows: np.ndarray, pad: int) -> np.ndarray:
        """[len(rows), longest] int32: each row's prompt and outputs, padded with `pad`."""
        lengths = self.num_tokens[rows]
        width = int(lengths.max())
        ids = self.token_ids[rows, :width].astype(np.int32)
        ids[np.arange(width)[None, :] >= lengths[:, None]] = pad
        return ids

    def known_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Each row's token count, counting tokens that launched steps sample but whose values
        are not in token_ids yet (the next step reads them from ModelRunner.last_sampled): a row
        computed up to its known tokens has exactly one token more than it has computed."""
        computed, num_tokens = self.num_computed[rows], self.num_tokens[rows]
        return np.where(computed >= num_tokens, computed + 1, num_tokens)

    def append_sampled(self, rows: np.ndarray, seq_ids: np.ndarray, tokens: np.ndarray) -> None:
        """Appends the tokens a step sampled, skipping rows whose request has left since."""
        held = self.seq_ids[rows] == seq_ids
        if not held.all():
            rows, tokens = rows[held], tokens[held]
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
