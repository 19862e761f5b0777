"""``llm=transformers``: a local Hugging Face causal LM (cuda > mps > cpu), streamed.

Generation runs on a helper thread and streams text through ``TextIteratorStreamer``, so the
first sentence reaches TTS while the rest is still being generated. Barge-in sets a flag that
a ``StoppingCriteria`` reads after every token; closing the reply joins the thread.
The sampling options, chat template and key/value cache shared with ``llm=mlx`` live in
``nodes/llm/_local.py``, the turn and interrupts of every LLM in ``nodes/llm/_base.py``. The
weights and tokenizer are loaded and warmed up once per process; every session generates on
them from its own thread, with its own key/value cache.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from nodes._hub import check_available, ensure_installed, load_offline_first
from nodes._torch import check_device, pick_device
from nodes.llm._local import DTYPES, LocalLLM, SharedModel
from s2s_flow.errors import ConfigError
from s2s_flow.node import require

__all__ = ["TransformersLLM"]


@dataclass
class _TorchModel(SharedModel):
    device: str  # where it runs: llm.device resolved
    cache_kwarg: str  # generate()'s name for the key/value cache


class TransformersLLM(LocalLLM):
    """``AutoModelForCausalLM.generate`` on a helper thread, streamed token by token."""

    backend = "llm=transformers"

    def __init__(self, *, model: str = "Qwen/Qwen3-4B-Instruct-2507", device: str = "auto", dtype: str = "auto",
                 **options: Any) -> None:
        """``options``: the generation and history options of every local LLM (``LocalLLM``)."""
        super().__init__(model=model, **options)
        check_device(device, "llm.device")
        if dtype not in DTYPES:
            raise ConfigError(f"llm.dtype={dtype!r} is unknown: use one of {', '.join(DTYPES)} "
                              "(auto: the checkpoint's dtype on a GPU, float32 on CPU)")
        self.device, self.dtype = device, dtype
        self._thread: threading.Thread | None = None

    # generate() works on a copy of the model's generation config. A fast tokenizer refuses to
    # change its truncation or padding while another thread encodes ("Already borrowed"): ours
    # never asks for either, and a tokenizer.json that sets them is reset by the warm-up's
    # encode, before any session shares it.
    shared_safety = ("thread-safe: generate() only reads the weights (eval, inference_mode) and each session "
                     "passes its own key/value cache; the tokenizer is only read")

    def shared_key(self) -> tuple:
        return (self.model, self.device, self.dtype)

    def inference_key(self) -> str:
        return f"transformers:{self.model}:{self.device}"

    def inference_slots(self) -> int:
        """Generations at once: one per core (each one's matmuls take torch's whole pool; more at
        once only split it), so a speculative reply waits behind confirmed ones on a full machine."""
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1

    def setup(self) -> None:
        ensure_installed("torch", "transformers", extra="transformers")
        check_available(self.model, self.backend)  # before the multi-second torch import
        super().setup()

    def load_model(self) -> _TorchModel:
        torch, tf = self._torch, self._tf
        device = pick_device(torch, self.device, "llm.device")
        dtype = getattr(torch, self.dtype) if self.dtype != "auto" else torch.float32 if device == "cpu" else "auto"
        shown = "checkpoint dtype" if dtype == "auto" else str(dtype).removeprefix("torch.")
        self.ctx.progress(f"loading {self.model} on {device} ({shown})")

        def load(local_only: bool) -> tuple[Any, Any]:
            tokenizer = tf.AutoTokenizer.from_pretrained(self.model, local_files_only=local_only)
            model = tf.AutoModelForCausalLM.from_pretrained(self.model, dtype=dtype, local_files_only=local_only)
            return tokenizer, model

        tokenizer, model = load_offline_first(self.model, self.backend, load)
        # transformers 5.2x renamed generate's past_key_values to cache
        cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        return _TorchModel(model.to(device).eval(), tokenizer, device=device, cache_kwarg=cache_kwarg)

    def bind(self, loaded: _TorchModel) -> None:
        super().bind(loaded)
        self._device, self._cache_kwarg = loaded.device, loaded.cache_kwarg

    # imported when first used: in setup(), or in load_shared() when a server preloads the model
    @property
    def _torch(self) -> Any:
        return require("torch", "transformers")

    @property
    def _tf(self) -> Any:
        return require("transformers", "transformers")

    def generate(self, prompt_ids: list[int], stop: threading.Event) -> Generator[str, None, None]:
        torch, tf = self._torch, self._tf
        streamer = tf.TextIteratorStreamer(self._tokenizer, skip_prompt=True, skip_special_tokens=True)
        count, halted, stopping = [0], [False], self.ctx.stopping

        class Halt(tf.StoppingCriteria):
            """Read after every new token: stops generation on barge-in or shutdown."""

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                count[0] += 1
                halted[0] = stop.is_set() or stopping.is_set()
                return torch.full((input_ids.shape[0],), halted[0], dtype=torch.bool, device=input_ids.device)

        input_ids = torch.tensor([prompt_ids], device=self._device)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": self.max_tokens,
            "streamer": streamer,
            "stopping_criteria": tf.StoppingCriteriaList([Halt()]),
            "pad_token_id": next(
                (t for t in (self._tokenizer.pad_token_id, self._tokenizer.eos_token_id) if t is not None), None
            ),
        }
        if self.temperature > 0:
            kwargs |= {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}
        else:  # greedy; None silences the checkpoint's sampling defaults
            kwargs |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if self.seed is not None:
            torch.manual_seed(self.seed)
        cache, _ = self.reusable_cache(prompt_ids)
        if cache is not None:
            kwargs |= {self._cache_kwarg: cache, "return_dict_in_generate": True}
        failed: list[BaseException] = []

        def run() -> None:
            try:
                with torch.inference_mode():
                    out = self._model.generate(**kwargs)
                if cache is not None:  # keep it for the next turn, with the tokens it now holds
                    self._cache, self._cache_ids = cache, out.sequences[0][: cache.get_seq_length()].tolist()
            except BaseException as exc:  # re-raised on the node thread below
                failed.append(exc)
                streamer.end()  # wake the reader

        thread = self._thread = threading.Thread(target=run, name=f"{self.ctx.name}-generate", daemon=True)
        thread.start()
        try:
            for text in streamer:
                if stop.is_set():
                    break  # interrupted: what is still queued is stale
                if text:
                    yield text
        finally:
            stop.set()  # a closed reply (barge-in) stops the thread at its next token
            thread.join()
            self._thread = None
            self.last_reply_tokens = count[0]
            self.last_stop = "interrupted" if halted[0] else "length" if count[0] >= self.max_tokens else "eos"
        if failed:
            raise failed[0]

    def trim_cache(self, cache: Any, drop: int) -> bool:
        if not cache.is_croppable:
            return False
        if drop > 0:
            cache.crop(-drop)  # transformers 5.2 takes a negative count: what to drop
        return True

    def new_cache(self) -> Any:
        cache = self._tf.DynamicCache(config=self._model.config)
        return cache if cache.is_croppable else None

    def close(self) -> None:
        super().close()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        self._model = self._shared = None
