"""``llm=mlx``: a local model through mlx-lm, streamed (Apple Silicon; ``mlx[cpu]`` on Linux).

``mlx_lm.stream_generate`` runs on the node's own thread, one token per step, so a barge-in
flag is read between tokens and closing the reply closes the generation: no helper thread.
The weights are loaded and warmed up once per process; the sessions take turns generating, a
confirmed turn's reply before a speculative one's (the model's scheduler, one slot).
"""

from __future__ import annotations

import contextlib
import resource
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

from nodes._hub import check_available, ensure_installed, hub_snapshot
from nodes.llm._local import LocalLLM, SharedModel
from s2s_flow.node import require

__all__ = ["MLXLLM"]

class MLXLLM(LocalLLM):
    """``mlx_lm.stream_generate`` with a sampler from ``make_sampler`` (temperature 0: greedy)."""

    backend = "llm=mlx"

    def __init__(self, *, model: str = "mlx-community/Qwen3-4B-Instruct-2507-bf16", **options: Any) -> None:
        """``options``: the generation and history options of every local LLM (``LocalLLM``)."""
        super().__init__(model=model, **options)

    # The sampler, the prompt cache and the history are per session; the model and tokenizer
    # (whose streaming detokenizer mlx-lm copies for each generation) are shared.
    shared_safety = ("locked: one generation at a time in the process (MLX's Metal/CPU streams are not known "
                     "to be safe across threads): its scheduler's single slot, held to the last token")

    def shared_key(self) -> tuple:
        return (self.model,)

    def inference_key(self) -> str:
        return f"mlx:{self.model}"  # one slot (the default): one generation at a time

    def setup(self) -> None:
        ensure_installed("mlx", "mlx_lm", extra="mlx")
        check_available(self.model, self.backend)  # before the multi-second mlx_lm import
        self._import()
        super().setup()

    def _import(self) -> None:
        """mlx-lm and this session's sampler: in setup(), or in load_shared() when a server
        preloads the model without a setup()."""
        self._mx = require("mlx.core", "mlx")
        # mlx_lm.utils sets the process's open-file limit to (2048, 4096) at import, lowering it for
        # a server's every connection: the limit found is put back
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._mlx_lm = require("mlx_lm", "mlx")
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)
        except (ValueError, OSError):  # without privileges a lowered hard limit stays: its soft one, then
            with contextlib.suppress(ValueError, OSError):
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit[0], hard), hard))
        self._caches = require("mlx_lm.models.cache", "mlx")  # the prompt cache kept between turns
        sample_utils = require("mlx_lm.sample_utils", "mlx")
        # top_p=0 is mlx-lm's "off"; 1.0 keeps every token anyway
        self._sampler = sample_utils.make_sampler(temp=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0)

    def load_model(self) -> SharedModel:
        self._import()
        path = self._model_dir()
        self.ctx.progress(f"loading {self.model} on {self._mx.default_device()}")
        model, tokenizer = self._mlx_lm.load(str(path))
        return SharedModel(model, tokenizer)

    def _model_dir(self) -> Path:
        """The model's local directory: as given, from the hub cache, or downloaded when the hub answers."""
        patterns = require("mlx_lm.utils", "mlx").DEFAULT_ALLOW_PATTERNS
        return hub_snapshot(self.model, self.backend, allow_patterns=patterns, progress=self.ctx.progress)

    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "has_chat_template", self._tokenizer.chat_template))

    def template_kwargs(self) -> dict[str, Any]:
        # mlx-lm's tokenizer wrapper renames the switch for templates that spell it otherwise,
        # and would turn thinking on for every model that has <think> tokens if not told.
        return {"enable_thinking": self.enable_thinking, **self.chat_template_kwargs}

    def generate(self, prompt_ids: list[int], stop: threading.Event) -> Generator[str, None, None]:
        if self.seed is not None:
            self._mx.random.seed(self.seed)
        cache, keep = self.reusable_cache(prompt_ids)
        steps = self._mlx_lm.stream_generate(
            self._model, self._tokenizer, prompt_ids[keep:], max_tokens=self.max_tokens, sampler=self._sampler,
            prompt_cache=cache,
        )
        count, finish, tokens = 0, "eos", []
        try:
            for step in steps:
                tokens.append(step.token)
                count, finish = step.generation_tokens, step.finish_reason or finish
                if stop.is_set() or self.ctx.stopping.is_set():
                    finish = "interrupted"
                    break
                if step.text:
                    yield step.text
        except GeneratorExit:  # the reply was closed (barge-in)
            finish = "interrupted"
            raise
        finally:
            steps.close()
            self.last_reply_tokens = count
            self.last_stop = {"stop": "eos"}.get(finish, finish)
            if cache is not None:
                self._keep_cache(cache, prompt_ids + tokens)

    def trim_cache(self, cache: Any, drop: int) -> bool:
        self._caches.trim_prompt_cache(cache, drop)
        return True

    def new_cache(self) -> Any:
        cache = self._caches.make_prompt_cache(self._model)
        return cache if self._caches.can_trim_prompt_cache(cache) else None

    def _keep_cache(self, cache: Any, known: list[int]) -> None:
        """Keep the cache for the next turn with the tokens it holds (the prompt, then the reply)."""
        held = cache[0].offset if cache and hasattr(cache[0], "offset") else None
        if held is None:
            return
        if held > len(known):  # a token fed ahead of the one the reply stopped at
            self._caches.trim_prompt_cache(cache, held - len(known))
            held = len(known)
        self._cache, self._cache_ids = cache, known[:held]

    def close(self) -> None:
        super().close()
        self._model = self._shared = None
