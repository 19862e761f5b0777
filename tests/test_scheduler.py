"""The scheduler: drain on end of stream, failures (whatever ends a node's thread), signals,
interrupts, sessions."""

from __future__ import annotations

import signal
import subprocess
import threading

import pytest
from omegaconf import OmegaConf

from s2s_flow.errors import NodeFailed
from s2s_flow.graph import build_graph
from s2s_flow.messages import Transcript
from s2s_flow.rings import RingClosed
from s2s_flow.scheduler import Scheduler
from s2s_flow.validate import validate
from tests.support.managed import start_signalled_graph, wait_until
from tests.support.nodes import SETUP_BARRIERS

T = "tests.support.nodes."


def make(chain: dict, **extra) -> Scheduler:
    cfg = OmegaConf.create({"chain": list(chain), **chain, **extra})
    return validate(build_graph(cfg))


def scheduler(tmp_path, chain: dict, **extra) -> Scheduler:
    return Scheduler(make(chain, **extra), tmp_path)


def node(s: Scheduler, name: str):
    return s.graph.nodes[name].node


def test_end_of_stream_drains_every_message_in_order(tmp_path):
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource", "n": 500},
                             "up": {"_target_": T + "Upper", "delay_s": 0.0},
                             "out": {"_target_": T + "Collect"}},
                  rings={"out": {"text": {"capacity": 2}}})
    s.run()
    got = node(s, "out").got
    assert [m.text for m in got] == [f":{i}" for i in range(500)]
    assert node(s, "out").finished == 1
    assert s.ring_stats["up.text -> out.text"]["high_water"] <= 2
    assert s.ring_stats["src.text -> up.text"]["puts"] == 500


def test_a_failing_node_stops_the_graph_promptly_and_is_named(tmp_path):
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource", "n": 100000},
                             "up": {"_target_": T + "Upper"},
                             "out": {"_target_": T + "Collect", "fail_on": ":50"}})
    with pytest.raises(NodeFailed, match=r"node 'out' failed: RuntimeError: boom on :50"):
        s.run()
    assert [m.text for m in node(s, "out").got] == [f":{i}" for i in range(50)]  # nothing after the failure
    assert s.trace.nodes["src"][1].n_out < 100000, "the source was stopped, not drained"
    assert not [t for t in threading.enumerate() if t.name.startswith("node:")]
    # how soon it stops (target: well under a second): benchmarks/bench_timing.py


def test_a_node_stuck_in_process_is_closed_to_unblock_it_when_another_fails(tmp_path, monkeypatch):
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource", "n": 3},
                             "stuck": {"_target_": T + "Blocker", "wait_s": 20},
                             "out": {"_target_": T + "Collect"}})
    stuck = node(s, "stuck")

    def fail_once_stuck() -> None:  # another node fails while this one is blocked inside process()
        if stuck.inside.wait(20):
            s._fail("out", RuntimeError("disk full"))

    close_all, alive_at_teardown = s._close_all, []

    def teardown() -> None:  # the run's last close() of every node: too late to unblock anything
        alive_at_teardown.append(s._runs["stuck"].thread.is_alive())
        close_all()

    monkeypatch.setattr(s, "_close_all", teardown)
    threading.Thread(target=fail_once_stuck, daemon=True).start()
    with pytest.raises(NodeFailed, match="disk full"):
        s.run()
    assert stuck.released == [True], "close() let the blocked process() go (not its own time-out)"
    assert alive_at_teardown == [False], "closed while the run waited for its thread, which then ended"
    assert not [t for t in threading.enumerate() if t.name.startswith("node:")]


def test_setup_runs_in_parallel_and_a_setup_failure_names_the_node(tmp_path):
    SETUP_BARRIERS["overlap"] = threading.Barrier(2)  # passed only by two setups running at once
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource"}, "up": {"_target_": T + "Upper"},
                             "slow": {"_target_": T + "SlowSetup", "meet": "overlap"}},
                  nodes={"slow2": {"_target_": T + "SlowSetup", "meet": "overlap"}},
                  edges=["up.text -> slow2.text"])
    s.run()
    assert {e["node"] for e in s.trace.events if e["kind"] == "setup"} >= {"slow", "slow2"}
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource"}, "up": {"_target_": T + "Upper"},
                             "bad": {"_target_": T + "SlowSetup", "fail": True}})
    with pytest.raises(NodeFailed, match="node 'bad' failed: RuntimeError: model file is corrupt"):
        s.run()


def test_each_session_runs_on_a_fresh_instance_of_the_graph_and_records_its_conversation(tmp_path):
    s = scheduler(tmp_path, {"src": {"_target_": T + "TurnSource", "turns": 2, "sessions": ["a", "b", "c"]},
                             "up": {"_target_": T + "Upper"}, "out": {"_target_": T + "Collect"}})
    first = {name: spec.node for name, spec in s.graph.nodes.items()}
    s.run()
    last = {name: spec.node for name, spec in s.graph.nodes.items()}
    assert all(last[n] is not first[n] for n in first), "a node of its own for each session"
    assert all(n.closed for n in (*first.values(), *last.values()))
    assert [m.text for m in first["out"].got] == ["A:0", "A:1"], "no session's messages reach another's nodes"
    assert [m.text for m in last["out"].got] == ["C:0", "C:1"] and last["out"].finished == 1
    assert first["up"].setups == last["up"].setups == 1
    # turns go on rising from one session to the next: the run's one trace keeps them all apart
    assert s.trace.conversations == {1: "a", 2: "a", 3: "b", 4: "b", 5: "c", 6: "c"}
    assert [e["conversation"] for e in s.trace.events if e["kind"] == "session"] == ["a", "b", "c"]


def test_an_interrupt_in_one_session_does_not_drop_the_next_sessions_turns(tmp_path):
    s = scheduler(tmp_path, {"src": {"_target_": T + "TurnSource", "turns": 1, "sessions": ["a", "b"],
                                     "interrupt_at": 50},
                             "up": {"_target_": T + "Upper"}, "out": {"_target_": T + "Collect"}})
    s.run()
    assert [m.text for m in s.graph.nodes["out"].node.got] == ["B:0"]


def test_interrupt_flushes_stale_turns_closes_the_stream_and_lets_the_new_turn_through(tmp_path):
    s = scheduler(tmp_path, {"src": {"_target_": T + "CountSource", "n": 0},
                             "llm": {"_target_": T + "Streamer", "pieces": 200, "delay_s": 0.005},
                             "out": {"_target_": T + "Collect"}})
    llm, out = node(s, "llm"), node(s, "out")
    fed = threading.Event()

    def feed() -> None:  # a user turn, then barge-in by turn 2 while turn 1 streams
        wait_until(lambda: s._runs["llm"].inbox.rings, 10, 0.005)  # the session's rings exist after setup
        ring = s._runs["llm"].inbox.rings[0]
        ring.put(Transcript(turn=1, text="hello"))
        wait_until(lambda: any(m.turn == 1 for m in out.got), 10, 0.001)  # turn 1 is streaming
        s.interrupt(2)
        ring.put(Transcript(turn=2, text="stop"))
        fed.set()

    def produce():  # the session stays open until both turns are in; end of stream then drains them
        fed.wait(10)
        return iter(())

    s._runs["src"].node.produce = produce
    threading.Thread(target=feed).start()
    s.run()
    turn1 = [m for m in out.got if m.turn == 1]
    turn2 = [m for m in out.got if m.turn == 2]
    assert llm.interrupted == [2] and 1 in llm.closed_turns
    assert 0 < len(turn1) < 200 and not any(m.end for m in turn1)
    assert any(m.end for m in turn2)
    assert [e for e in s.trace.events if e["kind"] == "interrupt"][0]["turn"] == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_a_running_graph_and_every_node_thread(sig, tmp_path):
    proc = start_signalled_graph(tmp_path)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=10)  # a hang, not a figure: bench_timing.py measures it (target: 1 s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 10 s after {sig.name}: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == 130 and f"stopped by {sig.name}" in out, err
    assert "(0 node threads left)" in out


def test_returned_outputs_go_out_by_type_or_named_port_in_order(tmp_path):
    s = Scheduler(validate(build_graph(OmegaConf.create({
        "nodes": {"src": {"_target_": T + "CountSource", "n": 300, "turns": 3},
                  "split": {"_target_": T + "Split"},
                  "up": {"_target_": T + "Collect"},
                  "len": {"_target_": T + "CollectTranscripts"}},
        "edges": ["src.text -> split.text", "split.upper -> up.text", "split.length -> len.text"]}))), tmp_path)
    s.run()
    assert [m.text for m in node(s, "up").got] == [f":{i}" for i in range(300)]
    assert [m.text for m in node(s, "len").got] == [str(len(f":{i}")) for i in range(300)]
    table = s.trace.nodes["split"]
    assert [table[t].n_in for t in (1, 2, 3)] == [100, 100, 100]
    assert [table[t].n_out for t in (1, 2, 3)] == [200, 200, 200]


def test_a_node_sending_to_a_port_it_does_not_have_fails_naming_it(tmp_path):
    s = Scheduler(validate(build_graph(OmegaConf.create({
        "nodes": {"src": {"_target_": T + "CountSource", "n": 5},
                  "split": {"_target_": T + "Split", "bad_port": "lenght"},
                  "up": {"_target_": T + "Collect"},
                  "len": {"_target_": T + "CollectTranscripts"}},
        "edges": ["src.text -> split.text", "split.upper -> up.text", "split.length -> len.text"]}))), tmp_path)
    with pytest.raises(NodeFailed, match=r"node 'split' failed: TypeError: Split yielded to port 'lenght'; "
                                         r"its outputs are upper, length"):
        s.run()


@pytest.mark.parametrize(("chain", "consumer"), [
    ({"src": {"_target_": T + "CountSource", "n": 1}, "stream": {"_target_": T + "Handshake"},
      "out": {"_target_": T + "Collect"}}, "out"),
    ({"stream": {"_target_": T + "HandshakeSource"}, "up": {"_target_": T + "Upper"},
      "out": {"_target_": T + "Collect"}}, "up"),
], ids=["node", "source"])
def test_a_yielded_output_reaches_its_consumer_while_the_stream_waits(tmp_path, chain, consumer):
    """Wake-ups of yielded outputs are not deferred to the thread's next block: the stream's next
    step may be a long network read (an LLM between tokens, a live source between chunks)."""
    s = scheduler(tmp_path, chain)
    stream, out, asleep = node(s, "stream"), node(s, "out"), s._runs[consumer]
    runner = threading.Thread(target=s.run, daemon=True)
    runner.start()
    assert wait_until(lambda: asleep.inbox._waiter is not None, 5, 0.001)  # it needs a wake-up
    stream.go.set()
    assert wait_until(lambda: len(out.got) == 1, 5, 0.005), "the first piece was held back"
    stream.seen.set()
    runner.join(10)
    assert stream.in_time == [True]
    assert [m.text.strip(":").lower() for m in out.got] == ["first", "second"]


@pytest.mark.parametrize("chain, culprit", [
    ({"src": f"{T}CountSource", "bad": f"{T}ClosesRing", "out": f"{T}Collect"}, "bad"),
    ({"bad": f"{T}ClosesRingSource", "out": f"{T}CollectTranscripts"}, "bad"),
])
def test_a_ring_closed_that_ends_a_node_thread_fails_the_run_and_names_the_node(chain, culprit, tmp_path,
                                                                                monkeypatch):
    unreported: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unreported.append)
    cfg = OmegaConf.create({"chain": list(chain), **{k: {"_target_": v} for k, v in chain.items()}})
    s = Scheduler(validate(build_graph(cfg)), tmp_path)
    with pytest.raises(NodeFailed) as failed:
        s.run()
    assert failed.value.node == culprit and isinstance(failed.value.exc, RingClosed)
    assert f"node '{culprit}' failed: RingClosed" in str(failed.value)
    assert unreported == []


def test_an_exception_in_a_node_loop_s_own_cleanup_fails_the_run_and_names_the_node(tmp_path, monkeypatch):
    unreported: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unreported.append)
    cfg = OmegaConf.create({"chain": ["src", "out"], "src": {"_target_": f"{T}CountSource"},
                            "out": {"_target_": f"{T}CollectTranscripts"}})
    s = Scheduler(validate(build_graph(cfg)), tmp_path)
    close_outputs = s._close_outputs

    def broken(run):  # the engine's own cleanup raising, after the node's loop
        close_outputs(run)
        if run.name == "src":
            raise OSError("cleanup failed")

    monkeypatch.setattr(s, "_close_outputs", broken)
    with pytest.raises(NodeFailed, match="node 'src' failed: OSError: cleanup failed"):
        s.run()
    assert unreported == []
