"""From a composed config to a wired graph of node specs, without loading any model.

The chain (``chain:`` in conf/config.yaml, source -> vad -> stt -> llm -> tts -> sink)
is wired by port type: a message type produced upstream *flows* down the chain until a
stage consumes it, and each input port takes the nearest flowing producer of its type.
Ports a node lists in ``taps`` observe the nearest upstream producer even when the type
was consumed on the way (a sink that records transcripts). Stages whose ``_target_`` is
null (``stt=none``) are skipped. ``nodes:`` adds named nodes outside the chain and
``edges:`` ("src.port -> dst.port") wires them, or overrides a chain edge.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from s2s_flow.errors import ConfigError, answer_within
from s2s_flow.messages import Message
from s2s_flow.node import Node, joined_ports

__all__ = ["NodeSpec", "Edge", "Graph", "build_graph", "load_class"]


@dataclass
class NodeSpec:
    name: str  # node name in the graph, e.g. "llm" or "sink"
    path: str  # where its config lives, e.g. "llm" or "io.sink"
    choice: str | None  # the group option that chose it, e.g. "chat"
    cls: type[Node]
    params: dict[str, Any]
    node: Node | None = None  # built by validate.build_nodes (cheap __init__ only)

    @property
    def label(self) -> str:
        group = self.path.split(".")[0]
        return f"{group}={self.choice}" if self.choice else self.path


@dataclass
class Edge:
    src: str
    src_port: str
    dst: str
    dst_port: str
    type: type[Message]
    capacity: int = 0
    policy: str = ""
    explicit: bool = False

    @property
    def key(self) -> str:
        return f"{self.src}.{self.src_port} -> {self.dst}.{self.dst_port}"


@dataclass
class Graph:
    nodes: dict[str, NodeSpec] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # chain stages set to none

    def inputs_of(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.dst == name]

    def outputs_of(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.src == name]

    def instance(self) -> Graph:
        """The same graph with nodes of its own, for one session (a connection, a file of a batch):
        each node is built again from its validated parameters (cheap: ``__init__`` loads nothing),
        so its per-session state starts fresh, and its ``setup()`` finds the heavy parts already
        loaded (``Node.shared()``)."""
        nodes = {name: replace(spec, node=spec.cls(**spec.params)) for name, spec in self.nodes.items()}
        return Graph(nodes, self.edges, self.chain, self.skipped)


def load_class(target: str, where: str) -> type[Node]:
    module_name, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{where}._target_={target!r} names no importable node class ({exc}); "
                          "check the spelling, or that the module is installed") from exc
    if not (isinstance(cls, type) and issubclass(cls, Node)):
        raise ConfigError(f"{where}._target_={target!r} is not a s2s_flow Node subclass")
    return cls


def _spec(name: str, path: str, cfg: Any, choices: dict[str, str]) -> NodeSpec | None:
    if cfg is None:
        return None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} must be a node config (a mapping with _target_), got {cfg!r}")
    target = cfg.get("_target_")
    if target is None:
        return None
    try:
        params = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # a resolver failed: report its own answer, not OmegaConf's wrapper
        answer = answer_within(exc)
        if answer is not None:
            raise answer from None
        raise ConfigError(f"{path}: cannot resolve its values ({exc})") from None
    assert isinstance(params, dict)
    params = {k: v for k, v in params.items() if not str(k).startswith("_")}
    group = path.split(".")[0]
    return NodeSpec(name, path, choices.get(group), load_class(str(target), path), params)


def _ring_for(edge: Edge, producer: type[Node], rings_cfg: Any) -> None:
    capacity, policy = producer.port_rings.get(edge.src_port, edge.type.ring)
    override = rings_cfg.get(edge.dst, {}).get(edge.dst_port, {}) if rings_cfg else {}
    try:
        edge.capacity = int(override.get("capacity", capacity))
    except (TypeError, ValueError):
        raise ConfigError(f"rings.{edge.dst}.{edge.dst_port}.capacity={override.get('capacity')!r}: "
                          "must be a whole number >= 1") from None
    edge.policy = str(override.get("policy", policy))


def _parse_edge(text: str) -> tuple[str, str, str, str]:
    try:
        left, right = (s.strip() for s in text.split("->"))
        (src, src_port), (dst, dst_port) = left.split("."), right.split(".")
    except ValueError:
        raise ConfigError(f"edges: {text!r} is not of the form 'node.port -> node.port' "
                          "(e.g. 'stt.text -> log.in')") from None
    return src, src_port, dst, dst_port


def build_graph(cfg: DictConfig, choices: dict[str, str] | None = None) -> Graph:
    """Wire the chain and the explicit edges. Raises ConfigError; loads no model."""
    choices = choices or {}
    graph = Graph()
    for path in cfg.get("chain", []):
        name = path.split(".")[-1]
        spec = _spec(name, path, OmegaConf.select(cfg, path), choices)
        if spec is None:
            graph.skipped.append(path)
            continue
        graph.nodes[name] = spec
        graph.chain.append(name)
    for name, node_cfg in (cfg.get("nodes") or {}).items():
        if name in graph.nodes:
            raise ConfigError(f"nodes.{name}: the name is taken by a chain stage; pick another name")
        spec = _spec(name, f"nodes.{name}", node_cfg, choices)
        if spec is not None:
            graph.nodes[name] = spec

    explicit = [_parse_edge(str(e)) for e in cfg.get("edges") or []]
    explicit_dst = {(d, dp) for _, _, d, dp in explicit}

    flowing: dict[type[Message], tuple[str, str]] = {}  # type -> nearest producer still flowing
    produced: dict[type[Message], tuple[str, str]] = {}  # type -> nearest producer at all
    joining: dict[type[Message], tuple[str, str]] = {}  # joined_ports(), for their type's first consumer
    for name in graph.chain:
        cls = graph.nodes[name].cls
        joins = joined_ports(cls)
        consumed = []
        for port, typ in cls.inputs.items():
            if (name, port) in explicit_dst:
                continue
            pool = produced if port in cls.taps else flowing
            src = next(((s, p) for t, (s, p) in reversed(pool.items()) if issubclass(t, typ)), None)
            if src is not None:
                graph.edges.append(Edge(src[0], src[1], name, port, typ))
                if pool is flowing:
                    consumed.append(typ)
                    for t, join in list(joining.items()):
                        if issubclass(t, typ):
                            del joining[t]
                            if join != src:
                                graph.edges.append(Edge(join[0], join[1], name, port, typ))
        for typ in consumed:
            flowing = {t: v for t, v in flowing.items() if not issubclass(t, typ)}
        for port, typ in cls.outputs.items():
            flowing.pop(typ, None)
            produced.pop(typ, None)
            flowing[typ] = produced[typ] = (name, port)
            if port in joins:
                joining[typ] = (name, port)

    for src, src_port, dst, dst_port in explicit:
        for node, port, side in ((src, src_port, "outputs"), (dst, dst_port, "inputs")):
            if node not in graph.nodes:
                raise ConfigError(f"edges: no node {node!r} in the graph (nodes: {', '.join(graph.nodes)})")
            ports = getattr(graph.nodes[node].cls, side)
            if port not in ports:
                raise ConfigError(f"edges: {node} has no {side[:-1]} port {port!r} "
                                  f"({side}: {', '.join(ports) or 'none'})")
        src_type = graph.nodes[src].cls.outputs[src_port]
        dst_type = graph.nodes[dst].cls.inputs[dst_port]
        if not issubclass(src_type, dst_type):
            raise ConfigError(f"edges: {src}.{src_port} produces {src_type.__name__} but "
                              f"{dst}.{dst_port} takes {dst_type.__name__}")
        graph.edges.append(Edge(src, src_port, dst, dst_port, src_type, explicit=True))

    rings_cfg = cfg.get("rings") or {}
    for edge in graph.edges:
        _ring_for(edge, graph.nodes[edge.src].cls, rings_cfg)
    return graph
