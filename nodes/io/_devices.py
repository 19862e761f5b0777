"""Sound devices through sounddevice (PortAudio): import with an answer, pick a device, list them.

Imported lazily by the live-audio nodes, so composing a config never loads PortAudio.
"""

from __future__ import annotations

from typing import Any, Literal

from s2s_flow.errors import ConfigError, MissingDependency, S2SError
from s2s_flow.node import require

__all__ = ["load_sounddevice", "find_device", "stream_rate", "list_devices"]

Kind = Literal["input", "output"]

_PORTAUDIO_HELP = (
    "install it with `apt-get install libportaudio2` (Debian/Ubuntu), `dnf install portaudio` (Fedora) or "
    "`brew install portaudio` (macOS), then `pip install 's2s-flow[audio]'`"
)


class MissingPortAudio(MissingDependency):
    """sounddevice is installed but the PortAudio C library it loads is not."""

    def __init__(self, cause: Exception) -> None:
        self.module, self.extra = "sounddevice", "audio"
        self.command = "apt-get install libportaudio2 && pip install 's2s-flow[audio]'"
        S2SError.__init__(self, f"live audio (io=mic) needs the PortAudio library, which is missing ({cause}): "
                                f"{_PORTAUDIO_HELP}")


def load_sounddevice() -> Any:
    """The sounddevice module, or an error that says what to install."""
    try:
        return require("sounddevice", "audio")
    except OSError as exc:  # sounddevice raises OSError when libportaudio cannot be loaded
        raise MissingPortAudio(exc) from None


def _devices(sd: Any) -> list[dict[str, Any]]:
    return [dict(d) for d in sd.query_devices()]


def _table(sd: Any, kind: Kind | None = None) -> str:
    """One line per device (of ``kind`` if given): index, name, channels, default rate."""
    rows = []
    default_in, default_out = (int(x) for x in sd.default.device)
    for d in _devices(sd):
        if kind and not d[f"max_{kind}_channels"]:
            continue
        mark = ("<" if d["index"] == default_in else " ") + (">" if d["index"] == default_out else " ")
        rows.append(f"{mark}{d['index']:>3}  {d['name']:<40} in {d['max_input_channels']:>2}  "
                    f"out {d['max_output_channels']:>2}  {int(d['default_samplerate'])} Hz")
    return "\n".join(rows)


def list_devices() -> str:
    """What `s2s-run --list-devices` prints: every PortAudio device, defaults marked < (in) and > (out)."""
    sd = load_sounddevice()
    table = _table(sd)
    if not table:
        return ("no audio devices found: PortAudio sees no sound card and no sound server "
                "(is PulseAudio/PipeWire running for this user?)")
    return ("   #  name                                     channels   default rate   (< default input, "
            "> default output)\n" + table +
            "\nchoose with io.input_device=NAME|INDEX io.output_device=NAME|INDEX (a name may be a substring)")


def find_device(sd: Any, spec: str | int | None, kind: Kind, option: str) -> int:
    """The device index for ``spec``: None = the default, an index, or a (sub)string of a name."""
    devices = [d for d in _devices(sd) if d[f"max_{kind}_channels"] > 0]
    available = _table(sd, kind) or "  (none)"
    if spec is None or spec == "":
        index = int(sd.default.device[0 if kind == "input" else 1])
        if index < 0 or not any(d["index"] == index for d in devices):
            raise ConfigError(f"{option}: there is no default {kind} device. Pick one with {option}=NAME or "
                              f"INDEX among the {kind} devices:\n{available}")
        return index
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        index = int(spec)
        if not any(d["index"] == index for d in devices):
            raise ConfigError(f"{option}={spec}: no {kind} device has index {index}. The {kind} devices are:"
                              f"\n{available}")
        return index
    exact = [d for d in devices if d["name"].lower() == spec.lower()]
    found = exact or [d for d in devices if spec.lower() in d["name"].lower()]
    if len(found) == 1:
        return int(found[0]["index"])
    if not found:
        raise ConfigError(f"{option}={spec!r}: no {kind} device name contains {spec!r}. The {kind} devices are:"
                          f"\n{available}\n(`s2s-run --list-devices` lists them all)")
    names = ", ".join(f"{d['index']}: {d['name']!r}" for d in found)
    raise ConfigError(f"{option}={spec!r} matches several {kind} devices ({names}); give more of the name "
                      "or the index")


def stream_rate(sd: Any, device: int, kind: Kind, wanted: int | None, preferred: int, option: str) -> int:
    """The rate to open the device at: ``wanted`` if set, else ``preferred`` (no resampling) when the
    device takes it, else the device's default rate."""
    check = sd.check_input_settings if kind == "input" else sd.check_output_settings
    candidates = [wanted] if wanted else [preferred, int(sd.query_devices(device)["default_samplerate"])]
    error: Exception | None = None
    for rate in candidates:
        try:
            check(device=device, channels=1, dtype="float32", samplerate=rate)
            return rate
        except Exception as exc:  # PortAudioError or ValueError: this rate is not supported
            error = exc
    raise ConfigError(f"{option}: the {kind} device {sd.query_devices(device)['name']!r} cannot be opened at "
                      f"{' or '.join(f'{r} Hz' for r in candidates)} mono float32 ({error}); set another rate "
                      f"or device")
