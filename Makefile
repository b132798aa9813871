# krafla: `make` builds the engine (generic, avx2 and avx512 libraries); `make test` runs everything; `make serve` serves.
PYTHON ?= python3
VENV ?= .venv
BUILD ?= build

# Parallel by default: one compile per core unless -j is given (`make -j1` builds one file at a time).
NPROC := $(shell nproc 2>/dev/null || echo 1)
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(NPROC)
endif
# V=1 prints each compiler command; otherwise one progress line per file.
V ?= 0

# What this CPU runs, by the rule of krafla_twisted/engine/clib.py (ISA_FLAGS): a list of the flags
# it lacks is empty when it has them all.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has_flags = $(if $(filter-out $(CPU_FLAGS),$(1)),,yes)
HAVE_AVX2 := $(call has_flags,avx2 fma f16c)
HAVE_AVX512 := $(call has_flags,avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni)
ISA ?= $(if $(HAVE_AVX2),avx2,generic)
# The best library this CPU runs: the one clib.py loads, and the only one `make serve` builds.
BEST_ISA := $(if $(HAVE_AVX512),avx512,$(if $(HAVE_AVX2),avx2,generic))

CC ?= gcc
CFLAGS_COMMON := -std=c11 -O2 -fPIC -Wall -Wextra -Wno-unused-parameter -D_GNU_SOURCE -Iengine_c/include -Iengine_c/src -pthread
CFLAGS_generic := $(CFLAGS_COMMON)
CFLAGS_avx2 := $(CFLAGS_COMMON) -mavx2 -mfma -mf16c -DKR_HAVE_AVX2=1
CFLAGS_avx512 := $(CFLAGS_avx2) -mavx512f -mavx512bw -mavx512vl -mavx512vnni -DKR_HAVE_AVX512=1

# engine_c/src/<layer>/*.c and *.h, each layer using only the ones before it: runtime, types, format,
# kernels, tokenizer and sampler, model (tests/test_include_graph.py checks the #includes).
SOURCES := $(wildcard engine_c/src/*/*.c)
HEADERS := $(wildcard engine_c/include/*.h engine_c/src/*/*.h)
# One library per ISA; krafla_twisted/engine/clib.py loads the best this CPU runs ($KRAFLA_ISA overrides).
# `make lib` builds all three; ISA names the one `make test` / `make test-isa` run against.
# $KRAFLA_BUILD_ISAS narrows `make lib` (and so what setup.py builds and ships) to the ISAs it names,
# or to none ("none": an editable install whose library `make` builds beside it, as `make serve` does).
ISAS := $(if $(KRAFLA_BUILD_ISAS),$(filter-out none,$(KRAFLA_BUILD_ISAS)),generic avx2 avx512)
LIBRARIES := $(foreach isa,$(ISAS),$(BUILD)/$(isa)/libkrafla.so)
LIBRARY := $(BUILD)/$(ISA)/libkrafla.so

.PHONY: all lib libs test test-reference serve venv clean print-library print-libraries

all: lib
lib: $(LIBRARIES)

# The cross-ISA bitwise test (tests/test_cross_isa.py) loads every library this CPU runs; `libs` is
# the name it had before `lib` built all three.
libs: lib

# The progress line: each source's number in SOURCES, out of N_SOURCES (per ISA).
N_SOURCES := $(words $(SOURCES))
$(foreach i,$(shell seq $(N_SOURCES)),$(eval SOURCE_NUMBER_$(word $(i),$(SOURCES)) := $(i)))
ECHO_COMMAND = $(if $(filter 1,$(V)),,@)

define ISA_RULES
$(BUILD)/$(1)/obj/%.o: engine_c/src/%.c $(HEADERS)
	@mkdir -p $$(dir $$@)
	@printf '[%2s/%s] %-7s %s\n' '$$(SOURCE_NUMBER_$$<)' '$$(N_SOURCES)' '$(1)' '$$<'
	$$(ECHO_COMMAND)$$(CC) $$(CFLAGS_$(1)) $$(EXTRA_CFLAGS) -c $$< -o $$@

$(BUILD)/$(1)/libkrafla.so: $(patsubst engine_c/src/%.c,$(BUILD)/$(1)/obj/%.o,$(SOURCES))
	@echo '[link]  $(1)    $$@'
	$$(ECHO_COMMAND)$$(CC) -shared -pthread -o $$@ $$^ -lm
endef
$(foreach isa,$(ISAS),$(eval $(call ISA_RULES,$(isa))))

# The install runs setup.py, whose `make lib` must find the libraries built (order-only: a parallel
# build and the install's own make never compile the same objects at once). The install's make gets
# no MAKEFLAGS: pip does not pass this make's jobserver on.
PIP_INSTALL = env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL $(VENV)/bin/pip install
$(VENV)/.installed: setup.py | $(LIBRARIES)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(PIP_INSTALL) -q -e '.[test]' --config-settings editable_mode=compat
	touch $@

venv: $(VENV)/.installed

test: lib venv
	KRAFLA_ISA=$(ISA) $(VENV)/bin/python -m pytest -q tests --ignore=tests/reference

# The heavy independent check: numpy reference against Hugging Face transformers.
$(VENV)-reference/.installed: setup.py tests/reference/requirements.txt | $(LIBRARIES)
	$(PYTHON) -m venv $(VENV)-reference
	$(VENV)-reference/bin/pip install -q --upgrade pip
	env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL $(VENV)-reference/bin/pip install -q -e '.[test]' --config-settings editable_mode=compat
	$(VENV)-reference/bin/pip install -q -r tests/reference/requirements.txt
	touch $@

.PHONY: venv-reference
venv-reference: $(VENV)-reference/.installed

test-reference: $(LIBRARY) $(VENV)-reference/.installed
	KRAFLA_ISA=$(ISA) KRAFLA_REFERENCE=1 $(VENV)-reference/bin/python -m pytest -q tests/reference

# --- serve (server): the default model on http://127.0.0.1:8080/v1; e.g. SERVE_ARGS="--port 9000 -t 4"
# Only what serving needs: the library of the best ISA this CPU runs, compiled on every core while
# the package and its dependencies (not the test extras) install beside it; then the default model
# (krafla_twisted/cli/models.py DEFAULT_MODEL) is pulled and served. A tree where `make test`
# installed the full venv since setup.py last changed uses that one as it is.
SERVE_ARGS ?=
SERVE_LIBRARY := $(BUILD)/$(BEST_ISA)/libkrafla.so
SERVE_VENV := $(if $(shell [ $(VENV)/.installed -nt setup.py ] && echo fresh),,$(VENV)/.installed-serve)
.PHONY: serve-announce
# The venv comes first: make starts its install, then fills the other cores with compiles.
serve: serve-announce $(SERVE_VENV) $(SERVE_LIBRARY)
	@echo "make serve: [3/4] the default model (krafla pull; downloaded and converted once, then cached)"
	$(VENV)/bin/krafla pull
	@echo "make serve: [4/4] serving it (twistd krafla $(SERVE_ARGS))"
	$(VENV)/bin/twistd -n --pidfile= krafla $(SERVE_ARGS)

serve-announce:
	@echo "make serve: [1/4] the engine for $(BEST_ISA) ($(SERVE_LIBRARY), $(N_SOURCES) files, $(NPROC) cores)"
	@echo "make serve: [2/4] krafla and its dependencies in $(VENV) ($(if $(SERVE_VENV),pip install beside the build,installed already))"

# setup.py builds no library here (KRAFLA_BUILD_ISAS=none): the editable install loads build/'s.
$(VENV)/.installed-serve: setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	KRAFLA_BUILD_ISAS=none $(PIP_INSTALL) -q -e . --config-settings editable_mode=compat
	touch $@

clean:
	rm -rf $(BUILD)

print-library:
	@echo $(LIBRARY)

print-libraries:
	@echo $(LIBRARIES)

# --- tools (ecosystem): what the browser, nginx and node client tests drive, from Debian's packages.
# apt-get runs only when a program is missing (as root, or through sudo).
.PHONY: tools
test: tools
tools:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	  echo "installing from Debian's packages:$$missing"; \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

# --- test-isa: the kernel, packing, attention, batching, bitwise-reproducibility, reference and sampler
# tests on one more ISA build, e.g. `make test-isa ISA=avx512` (AVX-512 VNNI) or `ISA=generic`,
# next to the default avx2 `make test`. It builds and loads only that ISA's library.
ISA_TESTS ?= tests/test_kernels.py tests/test_legacy_kernels.py tests/test_kquant.py tests/test_pack.py \
	tests/test_kv_q8.py tests/test_attention.py tests/test_mixed_batch.py tests/test_batch_eval.py \
	tests/test_eval_all.py tests/test_reproducibility.py tests/test_reference_tiny.py tests/test_sampler.py \
	tests/test_quant_types.py
.PHONY: test-isa
test-isa: $(LIBRARY) venv
	KRAFLA_ISA=$(ISA) KRAFLA_LIB=$(abspath $(LIBRARY)) $(VENV)/bin/python -m pytest -q $(ISA_TESTS)
