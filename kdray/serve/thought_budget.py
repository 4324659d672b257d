"""A thinking model's thought cut at a budget of tokens (Anthropic's ``thinking.budget_tokens``).

The reply's request runs as usual while its thought has at most ``budget`` tokens. If the thought goes on past them,
that request is stopped, its output cut after the budget's last token, and a second request continues from the prompt,
that thought and ``</think>``, so the model answers. The prefix cache holds the first request's full pages, so the
second one prefills at most a page and the marker. The client sees one reply, under the first request's id: the cut
thought, the end marker (a token of the reply), then the answer.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from kdray.engine.request import CompletionOutput, RequestOutput, SamplingParams
from kdray.serve.async_engine import QueueFull, RequestStream
from kdray.serve.reasoning import ReasoningFormat, ReasoningSplit

RESUBMIT_WAIT = 0.05  # seconds between tries to submit the continuation while the engine is full


class BudgetedThought:
    """The stream of one chat request (``request``: its id, prompt and sampling) whose thought has ``budget`` tokens at
    most: the engine's outputs up to the budget, then the end marker and the continuation's outputs (sampled with
    ``after``, whose grammar holds the answer alone), all under the request's id."""

    def __init__(self, submit: Callable[[list], Awaitable[RequestStream]], stream: RequestStream,
                 request: tuple[str, list[int], SamplingParams], fmt: ReasoningFormat, opened: bool, budget: int,
                 after: SamplingParams):
        self.submit, self.stream, self.request, self.fmt, self.budget, self.after = (submit, stream, request, fmt,
                                                                                    budget, after)
        self.split = ReasoningSplit(fmt, opened)
        self.ids: list[int] = []  # the reply's ids so far (of the first request, while it runs)
        self.text = ""  # the reply's text handed on so far
        self.cut = False  # the thought was cut: the continuation runs

    def __aiter__(self):
        return self

    def abort(self):
        self.stream.abort()

    async def __anext__(self) -> RequestOutput:
        out = await self.stream.__anext__()
        out.request_id = self.request[0]
        if self.cut:
            return out
        c = out.outputs[0]
        self.ids += c.token_ids
        self.split.feed(self.ids)
        start, end = self.split.start, self.split.end
        thought = (len(self.ids) if end is None else end) - (start or 0)
        if start is None or thought <= self.budget:
            self.text += c.text
            return out
        return await self._cut(out, start + self.budget)

    async def _cut(self, out: RequestOutput, at: int) -> RequestOutput:
        """Stop the first request, hand on its output up to ``at`` ids and the end marker, and submit the
        continuation (unless ``max_tokens`` leaves no room for it: then the reply ends there, cut for length)."""
        self.stream.abort()
        self.cut = True
        rid, prompt, params = self.request
        c = out.outputs[0]
        kept = c.token_ids[:len(c.token_ids) - (len(self.ids) - at)]
        text = self.fmt.tokenizer.decode(self.ids[:at])[len(self.text):]
        room = params.max_tokens - at - 1
        ids = kept + [self.fmt.think_end] if room >= 0 else kept
        finish = "length" if room < 1 else None
        if finish is None:
            continued = (f"{rid}-continued", prompt + self.ids[:at] + [self.fmt.think_end],
                         replace(self.after, max_tokens=room))
            while True:
                try:
                    self.stream = await self.submit([continued])
                    break
                except QueueFull:  # the first request's slot comes back once the engine has seen its abort
                    await asyncio.sleep(RESUBMIT_WAIT)
        return replace(out, outputs=[CompletionOutput(0, text, ids, finish)], finished=finish is not None)
