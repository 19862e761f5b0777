# The two commands of the README. Both install what they need first (scripts/bootstrap.sh).
#   make run     # the offline default: spoken questions -> silero -> whisper -> SmolLM2 (llama-server) -> piper
#   make test    # the whole test suite on real components
.PHONY: run test bootstrap bench lint

bootstrap:
	scripts/bootstrap.sh

run: bootstrap
	.venv/bin/s2s-run recipe=local_cpu io.realtime=true

test: bootstrap
	.venv/bin/python -m pytest -q

lint: bootstrap
	.venv/bin/ruff check .

bench: bootstrap
	.venv/bin/python benchmarks/bench_engine.py
