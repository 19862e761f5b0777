"""Compose-time validation: everything that can be known before a model loads.

- node parameters against each class's ``__init__`` signature (unknown keys get a
  did-you-mean, wrong types name the expected one);
- every required input connected, every edge's types compatible, one producer per input;
- capability rules, phrased as the choice to make (``stt=none needs llm=chat``);
- sample rates consistent across audio edges; ring capacities and policies sane.

Nodes are built here (their ``__init__`` is cheap by contract and checks its own values,
e.g. a remote endpoint without an API key), never set up.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from omegaconf import OmegaConf

from s2s_flow.errors import ConfigError, S2SError
from s2s_flow.graph import Graph, NodeSpec, load_class
from s2s_flow.rings import POLICIES

__all__ = ["validate", "check_params"]


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, Path):
        return isinstance(value, str)
    base = origin or hint
    if base in (list, tuple, Sequence, typing.Sequence):
        return isinstance(value, (list, tuple))
    if base in (dict, Mapping, typing.Mapping):
        return isinstance(value, dict)
    return isinstance(value, base) if isinstance(base, type) else True


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _options(cls: type) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """The keyword options a node class takes, each with its type hint, and whether it takes any.

    A class whose ``__init__`` forwards ``**options`` to ``super().__init__`` takes the
    options of the next ``__init__`` up its MRO too, so a backend spells out only its own.
    """
    accepted: dict[str, tuple[inspect.Parameter, Any]] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:  # **options that go no further are the class's own business
            return accepted, cls.__init__ is not object.__init__
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # unresolvable annotations: skip type checks, keep key checks
            hints = {}
        params = inspect.signature(init).parameters.values()
        for p in params:
            if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                accepted.setdefault(p.name, (p, hints.get(p.name, p.annotation)))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return accepted, False
    return accepted, True


def check_params(cls: type, params: Mapping[str, Any], where: str) -> None:
    """Reject unknown keys (with a did-you-mean), missing required ones and wrong types."""
    options, takes_any = _options(cls)
    accepted = {name: p for name, (p, _) in options.items()}
    for key, value in params.items():
        if key not in accepted:
            if takes_any:
                continue
            close = difflib.get_close_matches(key, list(accepted), n=1)
            hint = f"did you mean {where}.{close[0]}?" if close else "it takes none"
            options_list = ", ".join(sorted(accepted)) or "none"
            raise ConfigError(f"{where}.{key} is not an option of {cls.__name__}: {hint} "
                              f"(options: {options_list})")
        hint_t = options[key][1]
        if isinstance(hint_t, str):
            continue
        if not _type_ok(value, hint_t):
            raise ConfigError(f"{where}.{key}={value!r} has the wrong type: {cls.__name__} expects "
                              f"{_hint_name(hint_t)}; fix the override or the YAML file")
    for name, p in accepted.items():
        if p.default is inspect.Parameter.empty and name not in params:
            raise ConfigError(f"{where}.{name} is required by {cls.__name__} and has no value: "
                              f"set {where}.{name}=... on the command line or in the config")


def _build(spec: NodeSpec) -> None:
    check_params(spec.cls, spec.params, spec.path)
    try:
        spec.node = spec.cls(**spec.params)
    except S2SError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{spec.path} ({spec.label}): {exc}") from exc


def _eligible(group: str, takes: type, conf_dir: Path | None) -> list[str]:
    """Options of a config group whose node class accepts ``takes`` on some input."""
    if conf_dir is None or not (conf_dir / group).is_dir():
        return []
    found = []
    for path in sorted((conf_dir / group).glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if not target:
            continue
        try:
            cls = load_class(str(target), group)
        except ConfigError:
            continue
        if any(issubclass(takes, t) for t in cls.inputs.values()):
            found.append(f"{group}={path.stem}")
    return found


def _unfed(graph: Graph, spec: NodeSpec, port: str, conf_dir: Path | None) -> ConfigError:
    """A required input has no producer: say which choice causes it and what to choose."""
    typ = spec.cls.inputs[port]
    wanted = typ.__name__
    if spec.name not in graph.chain:  # a side node (nodes:) is wired only by explicit edges
        producers = [f"{name}.{out}" for name, other in graph.nodes.items() if name != spec.name
                     for out, t in other.cls.outputs.items() if issubclass(t, typ)]
        edge = f"'{producers[0] if producers else '...'} -> {spec.name}.{port}'"
        offer = f" ({wanted} comes from {', '.join(producers)})" if producers else f" (nothing here makes {wanted})"
        replaced = (" If you set edges=[...] on the command line: it replaces the whole list, including the "
                    "edges a config group adds" if any(e.explicit for e in graph.edges) else "")
        return ConfigError(f"{spec.label} is outside the chain, so only an explicit edge feeds its input {port!r}: "
                           f"add {edge} to edges{offer}.{replaced}")
    idx = graph.chain.index(spec.name)
    upstream = graph.nodes[graph.chain[idx - 1]] if idx > 0 else None
    if upstream is None:
        return ConfigError(f"{spec.label} needs {wanted} on its input {port!r}, and nothing in the graph "
                           f"produces it; add a node that does and an edge '... -> {spec.name}.{port}'")
    sends = ", ".join(t.__name__ for t in upstream.cls.outputs.values()) or "nothing"
    skipped = [p for p in graph.skipped if p.split(".")[0] not in ("io",)]
    because = f" ({', '.join(s + '=none' for s in skipped)} skips a stage)" if skipped else ""
    group = spec.path.split(".")[0]
    eligible = [c for t in upstream.cls.outputs.values() for c in _eligible(group, t, conf_dir)]
    eligible = sorted(set(eligible) - {spec.label})
    fix = f"choose {' or '.join(eligible)}" if eligible else f"choose another {group} backend"
    if skipped:
        fix += f", or an {skipped[0]} backend instead of {skipped[0]}=none"
    return ConfigError(f"{spec.label} cannot take what {upstream.label} sends ({sends}){because}: it "
                       f"needs {wanted} on its input {port!r}. {fix[0].upper()}{fix[1:]}.")


def validate(graph: Graph, conf_dir: Path | None = None) -> Graph:
    """Build every node (cheaply) and check the wiring. Raises ConfigError."""
    if not graph.nodes:
        raise ConfigError("the graph is empty: every stage is set to none")
    for spec in graph.nodes.values():
        _build(spec)

    seen: dict[tuple[str, str], str] = {}
    for edge in graph.edges:
        if (edge.dst, edge.dst_port) in seen and not edge.explicit:
            continue
        if (edge.dst, edge.dst_port) in seen and seen[(edge.dst, edge.dst_port)] != "chain":
            raise ConfigError(f"edges: {edge.dst}.{edge.dst_port} has two producers; an input takes one edge")
        seen[(edge.dst, edge.dst_port)] = "explicit" if edge.explicit else "chain"
    # An explicit edge replaces the chain's edge into the same input.
    graph.edges = [e for e in graph.edges
                   if e.explicit or seen.get((e.dst, e.dst_port)) != "explicit"]

    for spec in graph.nodes.values():
        connected = {e.dst_port for e in graph.inputs_of(spec.name)}
        for port in spec.cls.inputs:
            if port not in connected and port not in spec.cls.optional_inputs | spec.cls.taps:
                raise _unfed(graph, spec, port, conf_dir)
        if spec.cls.inputs and not connected:
            first = next(iter(spec.cls.inputs))
            raise _unfed(graph, spec, first, conf_dir)

    for edge in graph.edges:
        if edge.policy not in POLICIES:
            raise ConfigError(f"rings.{edge.dst}.{edge.dst_port}.policy={edge.policy!r}: choose one of "
                              f"{', '.join(POLICIES)}")
        if edge.capacity < 1:
            raise ConfigError(f"rings.{edge.dst}.{edge.dst_port}.capacity={edge.capacity}: must be >= 1")
        src = graph.nodes[edge.src].node.port_rate(edge.src_port)  # type: ignore[union-attr]
        dst = graph.nodes[edge.dst].node.port_rate(edge.dst_port)  # type: ignore[union-attr]
        if src and dst and src != dst:
            a, b = graph.nodes[edge.src], graph.nodes[edge.dst]
            raise ConfigError(
                f"sample rates disagree on {edge.key}: {a.label} sends {src} Hz but {b.label} expects "
                f"{dst} Hz; make them equal (e.g. {a.path}.rate={dst} or {b.path}.sample_rate={src})")
    return graph
