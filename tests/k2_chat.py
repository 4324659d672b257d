"""A Kimi-K2-layout chat checkpoint made on the fly: k2-tiny's architecture with weights that follow SCRIPT,
Kimi-K2's tokenizer files (``tiktoken.model``, ``tokenizer_config.json``) and a K2-style chat template with tools.

After the assistant's header the model greets the user; with tools declared it calls get_weather and get_time in
K2's tool-call tokens; once a tool call is in the conversation it answers. The thinking variant (``thinking=True``,
as Kimi-K2-Thinking) first writes THOUGHT between ``<think>`` and ``</think>``, then the same. Decoding follows the
script whatever the temperature (the margins are wide); a token outside the script is followed by a uniform draw.

How: each scripted token's embedding is a direction of its own, and the LM head maps it to the next token.
Where the next token depends on the conversation, layer 0's attention looks for one marker token per head
(sharply: the query of any other token avoids the markers) and writes a flag the LM head reads. Every other
layer adds nothing.

    python tests/k2_chat.py /tmp/k2-chat [--thinking]    # writes the checkpoint (the README serves it)
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import regex
import torch
from safetensors.torch import load_file, save_file
from test_tokenizer import K2_SPECIALS, write_k2_dir

from kdray.model.presets import k2_tiny_path
from kdray.model.tokenizer import KIMI_PATTERN
from kdray.serve.reasoning import THINK, THINK_END
from kdray.serve.tool_calls import K2_ARGUMENTS, K2_CALL, K2_CALL_END, K2_SECTION, K2_SECTION_END

END = "<|im_end|>"  # a turn's end: the checkpoint's EOS
DECLARE, ID0, ID1 = "_declare", "functions.get_weather:0", "functions.get_time:1"
MARKERS = (DECLARE, K2_SECTION, ID0, ID1)  # "tool_declare": tools are declared; K2_SECTION: a call was made
GREETING = ["Hello!", " I am a tiny Kimi-K2,", " served by kdray.", END]
ANSWER = ["It is 12°C", " and raining in Paris,", " at 14:05.", END]
WEATHER_ARGUMENTS, TIME_ARGUMENTS = ['{"city": ', '"Paris"}'], ['{"timezone": ', '"Europe/Paris"}']
THOUGHT = ["Let me think.", " A greeting is polite."]


def _always(*chain: str) -> dict:
    return {a: [(b, (), ())] for a, b in zip(chain, chain[1:])}


# token -> [(next token, markers the conversation must hold, markers it must not)]
SCRIPT = {
    **_always(*GREETING), **_always(*ANSWER), **_always(K2_SECTION, K2_CALL), **_always(ID0, K2_ARGUMENTS),
    **_always(ID1, K2_ARGUMENTS), **_always(*WEATHER_ARGUMENTS, K2_CALL_END), **_always(*TIME_ARGUMENTS, K2_CALL_END),
    **_always(K2_SECTION_END, END),
    "<|im_middle|>": [(GREETING[0], (), (DECLARE, K2_SECTION)), (K2_SECTION, (DECLARE,), (K2_SECTION,)),
                      (ANSWER[0], (K2_SECTION,), ())],
    K2_CALL: [(ID0, (), (ID0,)), (ID1, (ID0,), ())],
    K2_ARGUMENTS: [(WEATHER_ARGUMENTS[0], (), (ID1,)), (TIME_ARGUMENTS[0], (ID1,), ())],
    K2_CALL_END: [(K2_CALL, (), (ID1,)), (K2_SECTION_END, (ID1,), ())],
}
# the thinking variant: the assistant's header opens a thought; what followed the header follows its end
THINKING_SCRIPT = {**SCRIPT, "<|im_middle|>": [(THINK, (), ())], **_always(THINK, *THOUGHT, THINK_END),
                   THINK_END: SCRIPT["<|im_middle|>"]}
GREETING_TEXT, ANSWER_TEXT, THOUGHT_TEXT = "".join(GREETING[:-1]), "".join(ANSWER[:-1]), "".join(THOUGHT)
CALLS = [("get_weather", {"city": "Paris"}, ID0), ("get_time", {"timezone": "Europe/Paris"}, ID1)]
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {name[4:]} of a place",
                                           "parameters": {"type": "object", "properties": {k: {"type": "string"}
                                                                                          for k in args}}}}
         for name, args, _ in CALLS]

CORPUS = (" You are Kimi, an AI assistant created by Moonshot AI. What is the weather in Paris, and the time?"
          " Hello there, how are you today? Return of system user assistant tool documents")

# K2's template (moonshotai/Kimi-K2-Instruct) with documents, a system_prompt template argument, and every message
# closed (K2's leaves the last one open without a generation prompt: continue_final_message would change nothing)
CHAT_TEMPLATE = """
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|># Tools
{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- if documents -%}
<|im_system|>documents<|im_middle|>{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and message.role != 'system' -%}
<|im_system|>system<|im_middle|>
    {{- system_prompt | default('You are Kimi, an AI assistant created by Moonshot AI.') -}}
<|im_end|>
  {%- endif -%}
  {%- set role_name = message.name or message.role -%}
  {%- if message.role == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>
  {%- elif message.role == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>
  {%- else -%}<|im_system|>{{ role_name }}<|im_middle|>
  {%- endif -%}
  {%- if message.role == 'assistant' and message.tool_calls -%}
    {%- if message.content -%}{{ message.content }}{%- endif -%}
<|tool_calls_section_begin|>
    {%- for call in message.tool_calls -%}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>
      {%- if call.function.arguments is string -%}{{ call.function.arguments }}
      {%- else -%}{{ call.function.arguments | tojson }}{%- endif -%}
<|tool_call_end|>
    {%- endfor -%}
<|tool_calls_section_end|>
  {%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}
{{ message.content }}
  {%- else -%}{{ message.content }}
  {%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
# K2-Thinking's way, simplified: an assistant message's reasoning_content in a thought before its content (K2-Thinking
# keeps only the current turn's); thinking=false (K2.5's argument) closes an empty thought, open_thought opens one
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>",
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|><think>"
    "{{ message.reasoning_content or '' }}</think>").replace(
    "<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
    "<|im_assistant|>assistant<|im_middle|>{%- if thinking is false -%}<think></think>{%- elif open_thought -%}"
    "<think>{%- endif -%}{%- endif -%}")
assert THINKING_TEMPLATE.count("<think>") == 3

SCALE = 10.0  # a scripted token's embedding, and a flag, in the residual stream (equal: the LM head compares them)
NEXT, WRONG = 40.0, 8.0  # LM head: the scripted next token; what each unmet condition costs
SHARP = 5.0  # query gain: a marker's attention score is about +-50


def _texts() -> list[str]:
    """The tokens after the 256 single bytes: the scripted ones that are not special tokens (named in
    tokenizer_config.json), then the pre-tokenizer's pieces of a little text (tiktoken encodes a piece that is a
    token as that token: prompts stay short)."""
    tokens = {t for script in (SCRIPT, THINKING_SCRIPT) for token, rules in script.items()
              for t in (token, *(r[0] for r in rules))} | set(MARKERS)
    scripted = sorted(t for t in tokens if t not in K2_SPECIALS.values())
    pieces = regex.findall(KIMI_PATTERN, json.dumps(TOOLS) + CORPUS, flags=regex.V1)
    return scripted + sorted({p for p in pieces if len(p.encode()) > 1} - set(scripted))


def token_ids() -> dict[str, int]:
    """The id of every token after the single bytes and of K2's special tokens, as the checkpoint numbers them."""
    texts = _texts()
    n = 256 + len(texts)
    return {t: 256 + i for i, t in enumerate(texts)} | {t: n + k for k, t in K2_SPECIALS.items()}


def make_k2_chat_checkpoint(path: Path, thinking: bool = False) -> Path:
    """Write the checkpoint to ``path`` (``thinking``: the variant that thinks first); return it."""
    ranks = {bytes([b]): b for b in range(256)} | {t.encode(): 256 + i for i, t in enumerate(_texts())}
    write_k2_dir(path, ranks)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE if thinking else CHAT_TEMPLATE, encoding="utf-8")
    ids = token_ids()
    src = k2_tiny_path()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(eos_token_id=ids[END], bos_token_id=ids["[BOS]"])
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    script = THINKING_SCRIPT if thinking else SCRIPT
    save_file(_scripted_weights(load_file(str(src / "model.safetensors")), cfg, ids, script),
              str(path / "model.safetensors"))
    return path


def _scripted_weights(t: dict[str, torch.Tensor], cfg: dict, ids: dict[str, int], script: dict
                      ) -> dict[str, torch.Tensor]:
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    keyed = list(dict.fromkeys([*script, *MARKERS]))  # tokens with a direction of their own
    dim = {token: d for d, token in enumerate(keyed)}
    other, flag = len(keyed), {m: len(keyed) + 1 + h for h, m in enumerate(MARKERS)}
    assert other + 1 + len(MARKERS) <= H and len(MARKERS) <= heads
    triggers = [token for token, rules in script.items() if any(r[1] or r[2] for r in rules)]
    watched = {token: {m for r in script[token] for m in (*r[1], *r[2])} for token in triggers}

    for name in t:
        if "layernorm" in name or name == "model.norm.weight":
            t[name] = torch.ones_like(t[name])
        elif name.endswith(("down_proj.weight", "o_proj.weight")):  # every layer adds nothing ...
            t[name] = torch.zeros_like(t[name])
    embed = torch.zeros_like(t["model.embed_tokens.weight"])
    embed[:, other] = SCALE
    for token, d in dim.items():
        embed[ids[token]] = 0
        embed[ids[token], d] = SCALE
    t["model.embed_tokens.weight"] = embed

    # ... but layer 0's attention: head h looks for MARKERS[h] from the triggers that watch it, writes flag h
    a = "model.layers.0.self_attn."
    q_a = torch.zeros_like(t[a + "q_a_proj.weight"])  # query groups: 0 the tokens that watch nothing, g + 1 trigger g
    q_a[0] = 1
    q_b = torch.zeros_like(t[a + "q_b_proj.weight"])
    kv_a = torch.zeros_like(t[a + "kv_a_proj_with_mqa.weight"])
    kv_b = torch.zeros_like(t[a + "kv_b_proj.weight"])
    o = torch.zeros_like(t[a + "o_proj.weight"])
    for g, token in enumerate(triggers):
        q_a[0, dim[token]] = 0
        q_a[g + 1, dim[token]] = 1
    for h, marker in enumerate(MARKERS):
        q_b[h * (nope + rope)] = -SHARP
        for g, token in enumerate(triggers):
            q_b[h * (nope + rope), g + 1] = SHARP if marker in watched[token] else -SHARP
        kv_a[h, dim[marker]] = 1  # the latent's dim h: marker h
        kv_b[h * (nope + v_dim), h] = 1  # head h's key ...
        kv_b[h * (nope + v_dim) + nope, h] = 1  # ... and value
        o[flag[marker], h * v_dim] = SCALE / cfg["kv_lora_rank"] ** 0.5  # the normed latent is sqrt(rank) long
    t.update({a + "q_a_proj.weight": q_a, a + "q_b_proj.weight": q_b, a + "kv_a_proj_with_mqa.weight": kv_a,
              a + "kv_b_proj.weight": kv_b, a + "o_proj.weight": o})

    # The LM head scores a rule NEXT, less WRONG per marker present that must not be or absent that must be
    head = torch.zeros_like(t["lm_head.weight"])
    for token, rules in script.items():
        for nxt, must, must_not in rules:
            head[ids[nxt], dim[token]] += NEXT - WRONG * len(must)
            for m in must:
                head[ids[nxt], flag[m]] += WRONG
            for m in must_not:
                head[ids[nxt], flag[m]] -= WRONG
    t["lm_head.weight"] = head
    return t


if __name__ == "__main__":
    out = Path(sys.argv[1])
    shutil.rmtree(out, ignore_errors=True)
    print(make_k2_chat_checkpoint(out, thinking="--thinking" in sys.argv[2:]))
