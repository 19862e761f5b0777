"""Tools for the tool-calling tests: plain functions named in config by import path
(``llm.tools=[tests.support.tools:get_weather]``), each described by its hints and docstring.

Deterministic: the same city always gives the same weather; the lookups take one of a few
words (an enum), so a small model answering through a server's grammar writes a short call.
``slow_lookup`` blocks until the test lets it go (``RELEASE``), so a test sees a tool still
running without timing anything.
With ``$S2S_TEST_TOOL_STAMPS`` set to a file, ``get_weather`` takes ``STAMPED_S`` seconds and
appends its own start and end there (in a run's subprocess too): the tool's clock, for checking
the metrics' tool time against.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Literal

WEATHER = {"paris": "sunny, 24 degrees", "rome": "cloudy, 18 degrees", "oslo": "snowing, minus 3 degrees"}
CALLS: list[tuple[str, dict]] = []  # every call, in order: (tool, arguments)
RELEASE = threading.Event()  # lets slow_lookup return
STAMPS_ENV = "S2S_TEST_TOOL_STAMPS"
STAMPED_S = 0.3

#: The Qwen2.5-Instruct chat template (Apache-2.0; also in llama.cpp's models/templates): ChatML,
#: the tools listed in the system message, calls written as <tool_call>{"name", "arguments"}</tool_call>,
#: results as <tool_response> in a user turn. SmolLM2 and the tiny Llama speak ChatML, so either
#: model takes it (llama-server --jinja --chat-template-file, or the HF tokenizer's chat_template).
TOOL_TEMPLATE_PATH = Path(__file__).with_name("qwen25_tools.jinja")
TOOL_TEMPLATE = TOOL_TEMPLATE_PATH.read_text()


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    CALLS.append(("get_weather", {"city": city}))
    stamps = os.environ.get(STAMPS_ENV)
    if stamps:
        start = time.monotonic()
        time.sleep(STAMPED_S)
        with open(stamps, "a") as out:
            out.write(json.dumps({"start": start, "end": time.monotonic()}) + "\n")
    return f"The weather in {city} is {WEATHER.get(city.strip().lower(), 'mild, 20 degrees')}."


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def convert_temperature(degrees: float, to: Unit, precision: int = 0,
                        style: Literal["short", "long"] = "short") -> str:
    """Convert a temperature between Celsius and Fahrenheit.

    :param degrees: the temperature to convert
    :param to: the unit to convert to
    :param precision: digits after the decimal point
    :param style: how to phrase the answer
    """
    value = degrees * 9 / 5 + 32 if Unit(to) is Unit.FAHRENHEIT else (degrees - 32) * 5 / 9
    return f"{value:.{precision}f} {Unit(to).value}"


def broken_lookup(item: Literal["kettle", "toaster", "mug"]) -> str:
    """Check whether an item is in stock, in a database that is down.

    Args:
        item: The item to check.
    """
    CALLS.append(("broken_lookup", {"item": item}))
    raise ConnectionError("the database at db.internal:5432 refused the connection")


def slow_lookup(topic: Literal["maps", "globes", "atlases"]) -> str:
    """Find the aisle of a topic in a slow archive.

    Args:
        topic: What to look for.
    """
    CALLS.append(("slow_lookup", {"topic": topic}))
    RELEASE.wait(30)
    return f"The archive keeps {topic} in aisle 7."


KILL_ON_CALL: list[int] = []  # pids that weather_on_a_dying_server SIGKILLs at its first call
DYING_TOOL_S = 0.0  # how long weather_on_a_dying_server then runs on (long enough for a filler, if set)


def weather_on_a_dying_server(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    CALLS.append(("weather_on_a_dying_server", {"city": city}))
    while KILL_ON_CALL:  # the model's server dies while the tool runs: the round's next request finds it gone
        os.kill(KILL_ON_CALL.pop(), signal.SIGKILL)
        time.sleep(DYING_TOOL_S)
    return f"The weather in {city} is {WEATHER.get(city.strip().lower(), 'mild, 20 degrees')}."


def no_hints(city):  # noqa: ANN001 - on purpose: a tool the model cannot be told how to call
    """Has a parameter without a type hint."""
    return city


def takes_a_set(cities: set[str]) -> str:
    """Has a parameter whose type has no JSON schema."""
    return ",".join(cities)


def undocumented(city: str) -> str:
    return city
