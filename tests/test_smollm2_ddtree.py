"""The built-in default: SmolLM2-135M-Instruct with its shipped DFlash drafter is lossless under DDTree."""
from __future__ import annotations

import pytest

from kdray import LLM, SamplingParams
from kdray.train_drafter import encode_prompt

pytestmark = pytest.mark.slow

# One held-out prompt per category of the drafter corpus (`python -m kdray.drafter_corpus build`, seed 0): their
# source documents were never trained on.
HELDOUT = {
    "math": "Add the fractions 5/12 and 6/9, and simplify the result.",
    "writing": "Write a short poem about delinquently.",
    "how-to": 'Explain how to teach a child the word "measure".',
    "conversation": 'Let\'s chat: what comes to mind when you hear the word "mishmashes"?',
    "explanation": 'What does the word "sleazes" mean? Use it in two example sentences.',
    "code": "Give a small code example that illustrates PCA, and explain it.",
}


def test_greedy_ddtree_equals_ar_on_heldout_prompts(smollm2):
    prompts = [encode_prompt(smollm2.tokenizer, p, smollm2.config.vocab_size) for p in HELDOUT.values()]
    params = SamplingParams(max_tokens=32)
    ar = LLM(model=smollm2, spec="ar").generate(prompt_token_ids=prompts, sampling_params=params)
    dd = LLM(model=smollm2, budget=32).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in dd] == [o.outputs[0].token_ids for o in ar]
    tau = sum(o.metrics["tau"] for o in dd) / len(dd)
    print(f"mean tau {tau:.2f}: " + ", ".join(f"{c} {o.metrics['tau']:.2f}" for c, o in zip(HELDOUT, dd)))
    assert tau > 2.0  # the shipped drafter is accepted, not just lossless (the corpus drafter: ~3 on the H200)
