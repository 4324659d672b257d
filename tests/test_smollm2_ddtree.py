"""The built-in default: SmolLM2-135M-Instruct with its shipped DFlash drafter is lossless under DDTree."""
from __future__ import annotations

import pytest

from kdray import LLM, SamplingParams
from kdray.train_drafter import topic_prompts

pytestmark = pytest.mark.slow


def test_greedy_ddtree_equals_ar_on_heldout_prompts(smollm2):
    _, heldout = topic_prompts(smollm2.tokenizer, smollm2.config.vocab_size)
    prompts = [p[:96] for p in heldout[:3]]
    params = SamplingParams(max_tokens=32)
    ar = LLM(model=smollm2, spec="ar").generate(prompt_token_ids=prompts, sampling_params=params)
    dd = LLM(model=smollm2, budget=32).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in dd] == [o.outputs[0].token_ids for o in ar]
    assert sum(o.metrics["tau"] for o in dd) / len(dd) > 1.2  # the shipped drafter is accepted, not just lossless
