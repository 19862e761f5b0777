"""``llm=responses``: any OpenAI Responses API server (llama-server, vLLM, OpenAI), streamed.

Stateless on purpose (``store: false``, the whole bounded history every turn): no server
keeps our conversation, so servers are interchangeable and a dropped reply costs nothing.
The system prompt travels as the first input item, a ``system`` message, rather than as
``instructions``: the prompt is then laid out exactly as ``llm=chat`` lays it out (the
same rendered prefix, so llama.cpp's prompt cache serves both), and servers that map
Responses onto their chat path handle message items everywhere while ``instructions``
support varies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from nodes._http import RemoteError
from nodes.llm._conversation import ToolCall
from nodes.llm._remote import RemoteLLM
from nodes.llm._tools import named_tool
from s2s_flow.messages import TextDelta, Transcript

_REASONING_EVENTS = frozenset({
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
})


class ResponsesLLM(RemoteLLM):
    """``POST {base_url}/responses`` with SSE streaming; text user turns."""

    inputs = {"text": Transcript}
    outputs = {"text": TextDelta}

    path = "/responses"
    api_name = "Responses API"
    hint_404 = "use llm=chat (or fix llm.base_url if it should end in /v1)"

    def request_body(self, tool_choice: str = "auto") -> dict[str, Any]:
        body = self.generation_options()
        history = self.ctx.session.history(self.conversation)
        body["input"] = [item for m in history.messages() for item in input_items(m)]
        if self.toolbox:
            body["tools"] = [tool.responses_schema() for tool in self.toolbox.tools.values()]
            name = named_tool(tool_choice)
            body["tool_choice"] = {"type": "function", "name": name} if name else tool_choice
            if self.prefill(tool_choice):
                body["input"] += input_items({"role": "assistant", "content": self.prefill(tool_choice)})
        body["stream"] = self.stream
        body["store"] = False
        if self.max_tokens is not None:
            body["max_output_tokens"] = self.max_tokens
        if self.reasoning_effort is not None:
            body["reasoning"] = {"effort": self.reasoning_effort}
        return {**body, **self.extra_body}

    def stream_texts(self, events: Iterator[tuple[str, Any]]) -> Iterator[str | ToolCall]:
        reasoning, usage, stop, spoke = 0, None, None, False
        calls: dict[str, dict[str, Any]] = {}  # function_call items by item id, in stream order
        for event, data in events:
            if not isinstance(data, dict):
                continue
            kind = data.get("type") or event
            if kind == "response.output_text.delta":
                if data.get("delta"):
                    spoke = True
                    yield data["delta"]
            elif kind in _REASONING_EVENTS:
                reasoning += 1  # thinking is not spoken
            elif kind in ("response.output_item.added", "response.output_item.done"):
                item = data.get("item") or {}
                if item.get("type") == "function_call":
                    call = calls.setdefault(item.get("id") or item.get("call_id") or str(len(calls)), {})
                    call.update({k: v for k, v in item.items() if v not in (None, "")})
            elif kind == "response.function_call_arguments.delta":
                call = calls.setdefault(data.get("item_id") or str(len(calls)), {})
                call["streamed"] = call.get("streamed", "") + (data.get("delta") or "")
            elif kind == "response.function_call_arguments.done":
                calls.setdefault(data.get("item_id") or str(len(calls)), {})["arguments"] = data.get("arguments") or ""
            elif kind in ("response.completed", "response.incomplete"):
                response = data.get("response") or {}
                usage = response.get("usage")
                stop = (response.get("incomplete_details") or {}).get("reason") or response.get("status")
            elif kind in ("error", "response.failed"):
                raise self.server_error(data)
        self.log_reply(usage=usage, reasoning=reasoning, stop=stop, spoke=spoke or bool(calls))
        yield from self._calls(calls.values())

    def _calls(self, items: Iterable[dict[str, Any]]) -> Iterator[ToolCall]:
        """function_call items as tool calls: the id is the ``call_id``, the arguments as the
        ``done`` event or item gave them, else as their deltas added up."""
        calls = ({"id": item.get("call_id") or item.get("id"), "name": item.get("name"),
                  "arguments": item.get("arguments", item.get("streamed", ""))} for item in items)
        return self.toolbox.from_server(calls, turn=self._turn or 0, sender=f"the server at {self.client.base_url}",
                                        error=RemoteError)

    def full_reply(self, answer: Any) -> list[str | ToolCall]:
        if not isinstance(answer, dict) or answer.get("error") or answer.get("status") == "failed":
            raise self.server_error(answer)
        texts, reasoning, calls = [], 0, []
        for item in answer.get("output") or ():
            if item.get("type") == "reasoning":
                reasoning += 1
            if item.get("type") == "function_call":
                calls.append(item)
            if item.get("type") != "message":
                continue
            texts += [c.get("text", "") for c in item.get("content") or () if c.get("type") == "output_text"]
        text = "".join(texts)
        stop = (answer.get("incomplete_details") or {}).get("reason") or answer.get("status")
        self.log_reply(usage=answer.get("usage"), reasoning=reasoning, stop=stop, spoke=bool(text or calls))
        return [text, *self._calls(calls)]

    def server_error(self, data: Any) -> RemoteError:
        return RemoteError(f"the server at {self.client.base_url} reported an error: {_error_text(data)}")


def input_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message as Responses input items: typed text parts (``input_text`` in, ``output_text``
    out; early llama.cpp builds refuse untyped assistant text), ``function_call`` and
    ``function_call_output`` items for a tool round."""
    role = message["role"]
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}]
    items = []
    if message.get("content"):
        kind = "output_text" if role == "assistant" else "input_text"
        items.append({"type": "message", "role": role, "content": [{"type": kind, "text": message["content"]}]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append({"type": "function_call", "call_id": call["id"], "name": function["name"],
                      "arguments": function["arguments"]})
    return items


def _error_text(data: Any) -> str:
    """The message of an ``error`` event, a ``response.failed`` event or a failed answer."""
    if isinstance(data, dict):
        err = data.get("error") or (data.get("response") or {}).get("error") or data
        if isinstance(err, dict) and err.get("message"):
            code = err.get("code")
            return f"{err['message']}" + (f" ({code})" if code else "")
    return str(data)[:300]
