"""The offline API where vLLM's names differ: dict prompts, ``LLM.chat``, ``tensor_parallel_size`` /
``enforce_eager`` / ``speculative_config``, the device it picks, and the outputs' prompt fields."""
import pytest
import torch
from k2_chat import ANSWER_TEXT, CALLS, GREETING_TEXT, TOOLS, make_k2_chat_checkpoint

from kdray import LLM, SamplingParams
from kdray.engine.args import EngineArgs
from kdray.llm import engine_args_from_vllm

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="k2-tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def k2_chat_llm(tmp_path_factory):
    return LLM(model=str(make_k2_chat_checkpoint(tmp_path_factory.mktemp("k2-chat"))), device="cpu")


def test_dict_prompts_and_the_outputs_prompt_fields(tiny):
    params = SamplingParams(max_tokens=4)
    by_dict = tiny.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}], params)
    assert [o.outputs[0].token_ids for o in by_dict] == \
        [o.outputs[0].token_ids for o in tiny.generate(prompt_token_ids=[[5, 6, 7], [8]], sampling_params=params)]
    out = by_dict[0]
    assert (out.prompt, out.prompt_token_ids) == (None, [5, 6, 7])
    assert (out.outputs[0].cumulative_logprob, out.outputs[0].logprobs) == (None, None)  # not asked for
    for bad, message in [({"prompt": "x"}, "has no tokenizer"), ({"prompt_token_ids": [1], "prompt": "x"},
                                                                 "holds 'prompt' .* or 'prompt_token_ids'"),
                         ({"multi_modal_data": {}}, "not \\['multi_modal_data'\\]"), ([1, 2], "not list")]:
        with pytest.raises(ValueError, match=message):
            tiny.generate([bad])


def test_outputs_carry_logprobs_and_their_sum_when_asked(tiny):
    """vLLM's shape: per token ``{token id: Logprob}``, the emitted token first (with its rank), then the top k."""
    c = tiny.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=5, logprobs=2,
                                                                                   temperature=1.0, seed=1))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    for t, d in zip(c.token_ids, c.logprobs):
        assert list(d)[0] == t and 2 <= len(d) <= 3
        ranks = sorted(lp.rank for u, lp in d.items() if u != t or lp.rank <= 2)
        assert ranks[:2] == [1, 2] and all(lp.logprob <= 0 for lp in d.values())
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))


def test_chat_renders_the_template_with_tools_and_template_arguments(k2_chat_llm):
    greeting, calls = k2_chat_llm.chat([USER, USER], SamplingParams(max_tokens=20), tools=None), \
        k2_chat_llm.chat(USER, SamplingParams(max_tokens=20), tools=TOOLS)
    assert [o.outputs[0].text for o in greeting] == [GREETING_TEXT] * 2
    assert calls[0].outputs[0].text.startswith(CALLS[0][2]) and calls[0].prompt.startswith("<|im_system|>tool_declare")
    assert k2_chat_llm.tokenizer.encode(calls[0].prompt) == calls[0].prompt_token_ids
    briefed = k2_chat_llm.chat(USER, SamplingParams(max_tokens=1), chat_template_kwargs={"system_prompt": "Be brief."})
    assert "<|im_middle|>Be brief.<|im_end|>" in briefed[0].prompt
    called = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALLS[0][2], "type": "function", "function": {"name": CALLS[0][0], "arguments": CALLS[0][1]}}]},
        {"role": "tool", "tool_call_id": CALLS[0][2], "content": "12°C"}]
    assert k2_chat_llm.chat(called, SamplingParams(max_tokens=20))[0].outputs[0].text == ANSWER_TEXT
    cont = k2_chat_llm.chat([*USER, {"role": "assistant", "content": "Hello"}], SamplingParams(max_tokens=1),
                            add_generation_prompt=False, continue_final_message=True)
    assert cont[0].prompt.endswith("<|im_middle|>Hello")


def test_vllm_engine_argument_names():
    args = engine_args_from_vllm({"tensor_parallel_size": 1, "enforce_eager": True, "speculative_config": {
        "method": "dflash", "model": "random", "num_speculative_tokens": 3, "budget": 8}})
    assert args == {"tp": 1, "cuda_graphs": False, "spec": "chain", "drafter": "random", "block_size": 4, "budget": 8}
    llm = LLM(model="k2-tiny", device="cpu", dtype="float32", tensor_parallel_size=1, enforce_eager=True,
              speculative_config={"method": "ddtree", "model": "random", "num_speculative_tokens": 3})
    a = llm.args
    assert (a.spec, a.drafter, a.block_size, a.cuda_graphs) == ("ddtree", "random", 4, False)


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_config": {"method": "eagle"}}, "speculative_config.method='eagle' is not supported"),
    ({"speculative_config": {"prompt_lookup_max": 4}}, "speculative_config.prompt_lookup_max is not supported"),
    ({"speculative_config": {"num_speculative_tokens": 0}}, "num_speculative_tokens=0 must be an integer >= 1"),
    ({"tensor_parallel_size": 2, "tp": 1}, "tensor_parallel_size and tp disagree"),
    ({"speculative_config": {"model": "random"}, "drafter": "/ckpt"}, "speculative_config.model and drafter"),
])
def test_vllm_names_kdray_cannot_honour_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="k2-tiny", **kwargs)


def test_the_device_is_the_gpu_when_one_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    resolved = EngineArgs(model="k2-tiny", **engine_args_from_vllm({"tensor_parallel_size": 1})).resolve()
    assert (resolved.device, resolved.dtype) == ("cuda", "bfloat16")
