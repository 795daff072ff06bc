# Set-up is idempotent: `make serve` and `make test` each create .venv, install the data and the
# Python dependencies when missing, then do their job. `make serve` installs what serving and building
# need; `make test` (and `make lint`) add the dev tools (about 8 s more here), so a first answer does not
# wait for pytest, mypy and schemathesis.
# Python 3.10 to 3.12; 3.11 first: the pinned torch wheels (constraints/cpu.txt) are built for it.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.10 || command -v python3)
CONSTRAINTS := constraints/cpu.txt
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
LADDER ?= ladders/default
CHECKPOINT ?= models/checkpoints/resnet_exits_fmnist.pt
MEMBERS ?= models/checkpoints/densenet_fmnist.pt models/checkpoints/mobilenetv2_fmnist.pt \
	models/checkpoints/vgg_fmnist.pt

.PHONY: serve test data venv ladder lint clean

serve: $(STAMP) data ladder
	$(BIN)/anytime serve --ladder $(LADDER)

test: $(DEV_STAMP) data ladder
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

venv: $(DEV_STAMP)

# Editable install in compat mode puts the checkout on sys.path. The default editable finder ranks below
# sys.path, and onnxruntime.transformers appends a directory holding a namespace package named `models`,
# which then shadowed ours (the registry came up empty).
# The exact versions come from $(CONSTRAINTS); the cpu extra brings torch (a Jetson uses its JetPack's instead).
# pip compiles every module it installs in one process (22 s of a 62 s install here, torch's thousands of
# files); --no-compile and compileall on both cores after it took 39 + 13 s, side by side in fresh venvs. As
# pip's compile does, it skips what cannot compile on this Python (torch ships a 3.12-only test file).
COMPILE = $(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
	> /dev/null || true
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' || \
		{ echo "error: Python 3.10, 3.11 or 3.12 is required (found $$($(PYTHON) --version))" >&2; exit 1; }
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[cpu]' --config-settings editable_mode=compat
	$(COMPILE)
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[cpu,dev]' --config-settings editable_mode=compat
	$(COMPILE)
	touch $(DEV_STAMP)

data:
	@scripts/ensure-data.sh

# Builds the default ladder when it is missing or older than the checkpoint; `anytime build` itself
# redoes only the steps whose inputs changed.
ladder: $(LADDER)/ladder.json

$(LADDER)/ladder.json: $(CHECKPOINT) $(MEMBERS) | $(STAMP)
	@scripts/ensure-data.sh
	$(BIN)/anytime build $(CHECKPOINT) --members $(MEMBERS) --out $(LADDER)

lint: $(DEV_STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

clean:
	rm -rf $(VENV) ladders reports
