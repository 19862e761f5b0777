"""A managed server that fails to start is explained by the cause its log names, with the fix,
not by its last lines: a real llama-server with a missing model file, a port already held, `-hf`
with no hub to reach (a loopback endpoint where nothing listens: the same on a machine that has
the internet), and too little memory (an address-space limit, prlimit)."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from s2s_flow.compose import compose
from s2s_flow.model_server import ServerError, managed_server
from s2s_flow.server_causes import CAUSES, explain
from tests.support.managed import RECIPES, processes_with
from tests.support.servers import free_port


def _llama(model: str | Path, port: int, *, prefix: tuple[str, ...] = (), **extra):
    return OmegaConf.create({
        "command": [*prefix, "{llama_server}", "-m", "{model}", "--host", "{host}", "--port", "{port}", "-c", "512",
                    "-np", "1"],
        "model": str(model), "ready_url": f"http://127.0.0.1:{port}/health", "max_restarts": 0, **extra})


def _start_error(cfg, run_dir: Path) -> str:
    with pytest.raises(ServerError) as err, managed_server(cfg, run_dir):
        pass
    return str(err.value)


def test_a_missing_model_file_is_named_with_the_option_to_fix(llama_server_binary, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    text = _start_error(_llama(missing, free_port()), tmp_path)
    assert f"the model file {missing} cannot be read (No such file or directory)" in text
    assert "Fix: check server.model" in text
    assert "exiting due to model loading error" not in text, "the cause, not the log's last lines"


def test_a_port_held_by_another_process_says_so(llama_server_binary, smollm2_gguf, tmp_path):
    with socket.socket() as holder:  # bound, not listening: the probe finds the port free, the bind fails
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        text = _start_error(_llama(smollm2_gguf, port), tmp_path)
    assert f"it could not listen on 127.0.0.1:{port}: another process holds the port" in text
    assert "move this server to a free port" in text and f"sport = :{port}" in text
    assert "couldn't bind HTTP server socket" in text, "the log line it was read from is quoted"


def test_a_hub_model_without_the_hub_names_the_hub_and_the_offline_fix(llama_server_binary, tmp_path):
    """The recipe's own server block (`-hf ggml-org/gemma-4-E4B-it-GGUF`), an empty llama.cpp cache,
    and a hub endpoint where nothing listens: the message is the HTTPLIB line, three lines up in the
    log, not "failed to load model ''" at its end."""
    port = free_port()
    cfg, _ = compose(["recipe=llamacpp_gemma4", f"llm.base_url=http://127.0.0.1:{port}/v1"])
    server = OmegaConf.to_container(cfg.server, resolve=True)
    server["env"] = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}/", "MODEL_ENDPOINT": "",
                     "LLAMA_CACHE": str(tmp_path / "llama-cache")}
    server["max_restarts"] = 0
    text = _start_error(OmegaConf.create(server), tmp_path)
    assert "could not reach the model hub to download ggml-org/gemma-4-E4B-it-GGUF" in text
    assert "Could not establish connection" in text
    assert "huggingface-cli download ggml-org/gemma-4-E4B-it-GGUF" in text and "-m /path/to/model.gguf" in text
    assert "failed to load model ''" not in text and "exactly one out metadata" not in text
    assert not processes_with(f"--port\0{port}\0")


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="prlimit (util-linux) limits the server's memory")
def test_too_little_memory_is_named_with_what_to_ask_for_less(llama_server_binary, smollm2_gguf, tmp_path):
    cfg = _llama(smollm2_gguf, free_port(), prefix=("prlimit", "--as=300000000"))
    text = _start_error(cfg, tmp_path)
    assert "it ran out of memory while loading the model" in text
    assert "a smaller context (-c / --ctx-size" in text
    # where the limit bites first differs (the model's mmap, or a buffer after it): the line is quoted
    assert re.search(r"Its log says: .*(Cannot allocate memory|insufficient memory)", text), text


def test_an_unknown_failure_still_quotes_the_log_s_last_lines(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("print('the flux capacitor is misaligned', flush=True)\nraise SystemExit(3)\n")
    cfg = OmegaConf.create({"command": ["python3", str(script)], "ready_url": f"http://127.0.0.1:{free_port()}/health",
                            "max_restarts": 0})
    text = _start_error(cfg, tmp_path)
    assert "exited with code 3" in text and "the flux capacitor is misaligned" in text


def test_every_cause_of_the_table_is_found_in_the_line_a_server_prints():
    """The table's patterns against lines as llama-server and vLLM print them (from the runs above
    and vLLM's log), one per cause, and no line taken for another cause."""
    lines = {
        "no_hub": "0.00.008.578 E get_repo_commit: error: HTTPLIB failed: Could not establish connection",
        "no_https": "common_download_file_single: HTTPS is not supported. Please rebuild with -DLLAMA_OPENSSL=ON",
        "missing_file": "E gguf_init_from_file: failed to open GGUF file '/m/x.gguf' (No such file or directory)",
        "port_taken": "E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
        "no_memory": "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
    }
    assert set(lines) == {c.name for c in CAUSES}
    for name, line in lines.items():
        found = explain(f"loading\n{line}\nexiting\n", ["llama-server", "-hf", "org/repo"], host="h", port=1)
        assert found is not None and found[0] == name, (name, found)
        assert re.search(r"\. Fix: .+\. \(Its log says: ", found[1])


@pytest.mark.parametrize("recipe", [p for p in RECIPES if "-hf" in p.read_text()], ids=lambda p: p.stem)
def test_recipe_headers_no_longer_say_the_bundled_build_lacks_https(recipe):
    header = "\n".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
    assert "not s2s-build-llama-server's" not in header and "has no HTTPS" not in header
