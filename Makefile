.PHONY: setup test lint demo bench
setup:
	scripts/setup
test:
	scripts/test
lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
demo:
	scripts/demo
bench:
	.venv/bin/pdserve bench offline --hf-baseline
