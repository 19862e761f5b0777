"""Counting real model loads in tests of shared resources: the library's own loader runs,
and the test sees what it was asked to read."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from s2s_flow import node as contract


def fresh_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next setup() loads anew, not a model an earlier test's nodes still hold."""
    monkeypatch.setattr(contract, "_SHARED", weakref.WeakValueDictionary())


def count_loads(owner: object, name: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models ``owner.name`` (a library's real loader) reads, in order, as it reads them."""
    loads: list[str] = []
    load = getattr(owner, name)

    def counting(model, *args, **kwargs):
        loads.append(str(model))
        return load(model, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return loads


def warm_ups(said: list[str]) -> int:
    """How many warm-ups the progress lines of some setups announced."""
    return sum(line.startswith("warming up") for line in said)


class AtOnce:
    """A callable wrapped to count how many of its calls run at the same time (``most``): a shared
    model that its backend says is locked must never see two."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call, self.most = call, 0
        self._inside, self._count = 0, threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self._inside += 1
            self.most = max(self.most, self._inside)
        try:
            return self.call(*args, **kwargs)
        finally:
            with self._count:
                self._inside -= 1
