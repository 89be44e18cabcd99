# sglang-eagle3-mla -- see README.md. Variables can be overridden: make serve TARGET=... DRAFT=...
PY      ?= .venv/bin/python
TARGET  ?= smollm2
DRAFT   ?= out/draft
PORT    ?= 30000
SPEC    ?= --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

.PHONY: install test test-fast serve inspect train-draft eval-gsm8k gpu-prepare

install:  ## create .venv and install the package with SGLang 0.5.17 and the test tools
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -e '.[dev]'

test:  ## the whole CPU test suite (what CI runs)
	$(PY) -m pytest -q

test-fast:  ## skip the tests that load SmolLM2 or start fresh SGLang interpreters
	$(PY) -m pytest -q --ignore=tests/test_plugin.py --ignore=tests/test_smollm2.py

inspect:  ## check a draft against a target before serving: make inspect DRAFT=... TARGET=...
	$(PY) -m sglang_ext inspect-draft $(DRAFT) --target $(TARGET)

serve:  ## SGLang server with an Eagle3 draft (GPU): make serve TARGET=/models/Kimi-K2.5 DRAFT=/models/draft
	$(PY) -m sglang_ext inspect-draft $(DRAFT) --target $(TARGET)
	$(PY) -m sglang.launch_server --model-path $(TARGET) --speculative-algorithm EAGLE3 \
	  --speculative-draft-model-path $(DRAFT) $(SPEC) --port $(PORT) $(SERVE_ARGS)

train-draft:  ## not yet: the trainer lands with its own issue
	@echo "make train-draft: not yet implemented (see the trainer issue); nothing was trained" && exit 1

eval-gsm8k:  ## not yet: the GSM8K evaluation lands with its own issue
	@echo "make eval-gsm8k: not yet implemented (see the evaluation issue)" && exit 1

gpu-prepare:  ## stage SGLang 0.5.17 + this wheel in .devbundle/ for a lent GPU (../shared/device/README.md)
	bash ../shared/device/prepare.sh .
