"""The on-disk cache: one maker per entry, whole entries only (llama-server builds, corpora)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from s2s_flow.cache import cache_dir, make_once


def test_cache_dir_honours_s2s_flow_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("S2S_FLOW_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("S2S_FLOW_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "s2s-flow"


def test_callers_that_start_together_wait_for_one_maker(tmp_path: Path):
    made, seen = [], []

    def make(out: Path) -> None:
        made.append(out)
        time.sleep(0.2)  # the others arrive while this one works
        (out / "done").write_text("x")

    together = threading.Barrier(4, timeout=10)

    def call() -> None:
        together.wait()  # all four ask at once, so three must wait for the maker
        seen.append(make_once(tmp_path / "entry", make, marker="done"))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(made) == 1 and seen == [tmp_path / "entry"] * 4
    assert (tmp_path / "entry" / "done").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry"]  # no staging dir left


def test_a_failed_make_leaves_no_entry_and_the_next_call_makes_it(tmp_path: Path):
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        make_once(tmp_path / "entry", broken, marker="done")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock"]
    make_once(tmp_path / "entry", lambda out: (out / "done").write_text("ok"), marker="done")
    assert (tmp_path / "entry" / "done").read_text() == "ok"
    assert (tmp_path / "entry").stat().st_mode & 0o777 == 0o755  # readable by the others sharing a cache


def test_force_swaps_in_a_new_entry(tmp_path: Path):
    make_once(tmp_path / "entry", lambda out: (out / "done").write_text("old"), marker="done")
    make_once(tmp_path / "entry", lambda out: (out / "done").write_text("new"), marker="done")
    assert (tmp_path / "entry" / "done").read_text() == "old"  # cached: not made again
    make_once(tmp_path / "entry", lambda out: (out / "done").write_text("new"), marker="done", force=True)
    assert (tmp_path / "entry" / "done").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry"]
