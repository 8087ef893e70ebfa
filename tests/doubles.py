"""Test doubles: a model for the scheduler's tests that needs no tensors (chapter 12's FakeModel)."""
from petite_llm.engine.scheduler import SchedulerOutput, Sequence


class FakeModel:
    "A test double for the model: stores (token, position) per slot, reads contexts back by block."
    def __init__(self, block_size: int, vocab_size: int = 50):
        self.slots: dict[int, tuple[int, int]] = {}   # slot -> (token id, position) written there
        self.block_size, self.vocab_size = block_size, vocab_size

    def next_token(self, token_ids) -> int:
        "The token it 'samples': a deterministic function of the whole context."
        return hash(tuple(token_ids)) % self.vocab_size

    def slot(self, seq: Sequence, position: int) -> int:
        "The cache slot of seq's token at `position`, through its block table."
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def step(self, out: SchedulerOutput, pending=None) -> dict[int, list[int]]:
        "One step: store the new tokens, check what each sampling sequence reads, verify, sample."
        # pending: {seq id: [token]} sampled by the step before, not appended yet (async mode)
        sampled = {}
        rows = zip(out.seqs, out.num_computed_tokens, out.num_new_tokens, out.spec_token_ids,
                   out.do_sample)
        for seq, done, new, drafts, samples in rows:
            assert len(seq.block_table) * self.block_size >= done + new, f"seq {seq.seq_id}"
            known = seq.token_ids + (pending or {}).get(seq.seq_id, [])
            tokens = known + drafts               # what this step's positions hold
            for p in range(done, done + new):
                self.slots[self.slot(seq, p)] = (tokens[p], p)
            if samples:
                context = [self.slots.get(self.slot(seq, p)) for p in range(done + new)]
                expected = [(t, p) for p, t in enumerate(tokens)]
                assert context == expected, f"seq {seq.seq_id} reads a corrupted context"
                sampled[seq.seq_id] = self.verify(known, drafts)
        return sampled

    def verify(self, token_ids, drafts) -> list[int]:
        "Greedy verification: the drafts next_token agrees with, then its own next token."
        tokens = []
        for draft in drafts + [None]:             # None: past the drafts, nothing to agree with
            tokens.append(self.next_token(token_ids + tokens))
            if tokens[-1] != draft:
                return tokens

    def propose(self, seq: Sequence, num_drafts: int) -> list[int]:
        "Drafts for seq: its true continuation, wrong from a point that depends on the context."
        drafts, num_right = [], hash(tuple(seq.token_ids)) % (num_drafts + 1)
        for j in range(num_drafts):
            token = self.next_token(seq.token_ids + drafts)
            drafts.append(token if j < num_right else (token + 1) % self.vocab_size)
        return drafts

    def alone(self, seq: Sequence, max_model_len: int, eos_token_ids=()) -> tuple[list[int], str]:
        "The output tokens and finish reason of `seq` run alone, under the scheduler's stop rules."
        params, token_ids = seq.sampling_params, list(seq.prompt_token_ids)
        stop_ids = params.stop_token_set(eos_token_ids)
        while True:
            token_ids.append(self.next_token(token_ids))
            num_output = len(token_ids) - seq.num_prompt_tokens
            if num_output > params.min_tokens and token_ids[-1] in stop_ids:
                return token_ids[seq.num_prompt_tokens:], 'stop'
            if num_output >= params.max_tokens or len(token_ids) >= max_model_len:
                return token_ids[seq.num_prompt_tokens:], 'length'
