"""Batch invariance on a real model (chapter 21): SmolLM2-135M from its GGUF, in bfloat16 on two
threads. Five probes keep their lone tokens and logprobs, bit for bit, inside a batch of
mixed-length prompts, behind a 16-token step budget, and after a prefix-cache hit."""
import pytest

from petite_llm.engine.llm_engine import LLM
from petite_llm.model.sampling_params import SamplingParams
from petite_llm.model.weights import smollm2_gguf_path

PROBES = ["Name three colours.", "The capital of Italy is", "def quicksort(xs):",
          "Water boils at", "In 1969, the first"]
OTHERS = [f"Tell me about topic number {i}. " * (1 + i % 5) for i in range(11)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _answers(llm: LLM, prompts: list[str]) -> list[tuple]:
    "Each prompt's tokens and logprobs, all prompts in one generate call."
    return [(o.token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _llm(**options) -> LLM:
    return LLM(smollm2_gguf_path(), dtype='bfloat16', batch_invariant=True,
               kv_cache_memory=2**26, **options)


def _sharing(llm: LLM, **options) -> LLM:
    "Another batch-invariant engine on llm's model (a load costs seconds), with its own KV pool."
    return LLM(llm.engine.model, tokenizer=llm.tokenizer, batch_invariant=True,
               kv_cache_memory=2**26, **options)


def test_probes_keep_their_lone_answers(two_threads):
    "Alone, then among 16 prompts, then chunked 16 tokens a step, then after a prefix hit."
    llm = _llm(block_size=4)                      # blocks small enough for short prompts to fill
    alone = [_answers(llm, [p])[0] for p in PROBES]
    situations = {
        "batched": _answers(_sharing(llm, enable_prefix_caching=False), PROBES + OTHERS)[:5],
        "chunked": _answers(_sharing(llm, enable_prefix_caching=False, max_num_batched_tokens=16),
                            PROBES + OTHERS[:3])[:5],
        "prefix hit": _answers(llm, PROBES),            # their prompts are in llm's cache now
    }
    assert llm.engine.block_manager.num_hit_tokens > 0              # some prompts hit
    for name, answers in situations.items():
        kept = [a == b for a, b in zip(answers, alone)]
        assert all(kept), f"{name}: probes {[p for p, k in zip(PROBES, kept) if not k]} changed"
