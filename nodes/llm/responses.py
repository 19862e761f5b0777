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

from collections.abc import Iterator
from typing import Any

from nodes._remote import RemoteError, RemoteLLM
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

    def request_body(self) -> dict[str, Any]:
        body = self.generation_options()
        body["input"] = [
            {"type": "message", "role": m["role"], "content": m["content"]}
            for m in self.conversation.messages()
        ]
        body["stream"] = self.stream
        body["store"] = False
        if self.max_tokens is not None:
            body["max_output_tokens"] = self.max_tokens
        if self.reasoning_effort is not None:
            body["reasoning"] = {"effort": self.reasoning_effort}
        return {**body, **self.extra_body}

    def stream_texts(self, events: Iterator[tuple[str, Any]]) -> Iterator[str]:
        reasoning, usage, stop, spoke = 0, None, None, False
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
            elif kind in ("response.completed", "response.incomplete"):
                response = data.get("response") or {}
                usage = response.get("usage")
                stop = (response.get("incomplete_details") or {}).get("reason") or response.get("status")
            elif kind in ("error", "response.failed"):
                raise self.server_error(data)
        self.log_reply(usage=usage, reasoning=reasoning, stop=stop, spoke=spoke)

    def full_text(self, answer: Any) -> str:
        if not isinstance(answer, dict) or answer.get("error") or answer.get("status") == "failed":
            raise self.server_error(answer)
        texts, reasoning = [], 0
        for item in answer.get("output") or ():
            if item.get("type") == "reasoning":
                reasoning += 1
            if item.get("type") != "message":
                continue
            texts += [c.get("text", "") for c in item.get("content") or () if c.get("type") == "output_text"]
        text = "".join(texts)
        stop = (answer.get("incomplete_details") or {}).get("reason") or answer.get("status")
        self.log_reply(usage=answer.get("usage"), reasoning=reasoning, stop=stop, spoke=bool(text))
        return text

    def server_error(self, data: Any) -> RemoteError:
        return RemoteError(f"the server at {self.client.base_url} reported an error: {_error_text(data)}")


def _error_text(data: Any) -> str:
    """The message of an ``error`` event, a ``response.failed`` event or a failed answer."""
    if isinstance(data, dict):
        err = data.get("error") or (data.get("response") or {}).get("error") or data
        if isinstance(err, dict) and err.get("message"):
            code = err.get("code")
            return f"{err['message']}" + (f" ({code})" if code else "")
    return str(data)[:300]
