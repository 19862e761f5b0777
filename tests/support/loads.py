"""Counting real model loads in tests of shared resources: the library's own loader runs,
and the test sees what it was asked to read."""

from __future__ import annotations

import weakref

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
