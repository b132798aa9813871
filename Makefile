# krafla: `make` builds the engine (generic, avx2 and avx512 libraries); `make test` runs everything; `make serve` serves.
PYTHON ?= python3
VENV ?= .venv
BUILD ?= build
HAVE_AVX2 := $(shell grep -q avx2 /proc/cpuinfo 2>/dev/null && grep -q fma /proc/cpuinfo && grep -q f16c /proc/cpuinfo && echo yes)
ISA ?= $(if $(HAVE_AVX2),avx2,generic)

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
ISAS := generic avx2 avx512
LIBRARIES := $(foreach isa,$(ISAS),$(BUILD)/$(isa)/libkrafla.so)
LIBRARY := $(BUILD)/$(ISA)/libkrafla.so

.PHONY: all lib libs test test-reference serve venv clean print-library print-libraries

all: lib
lib: $(LIBRARIES)

# The cross-ISA bitwise test (tests/test_cross_isa.py) loads every library this CPU runs; `libs` is
# the name it had before `lib` built all three.
libs: lib

define ISA_RULES
$(BUILD)/$(1)/obj/%.o: engine_c/src/%.c $(HEADERS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS_$(1)) $$(EXTRA_CFLAGS) -c $$< -o $$@

$(BUILD)/$(1)/libkrafla.so: $(patsubst engine_c/src/%.c,$(BUILD)/$(1)/obj/%.o,$(SOURCES))
	$$(CC) -shared -pthread -o $$@ $$^ -lm
endef
$(foreach isa,$(ISAS),$(eval $(call ISA_RULES,$(isa))))

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $@

venv: $(VENV)/.installed

test: lib venv
	KRAFLA_ISA=$(ISA) $(VENV)/bin/python -m pytest -q tests --ignore=tests/reference

# The heavy independent check: numpy reference against Hugging Face transformers.
$(VENV)-reference/.installed: setup.py tests/reference/requirements.txt
	$(PYTHON) -m venv $(VENV)-reference
	$(VENV)-reference/bin/pip install -q --upgrade pip
	$(VENV)-reference/bin/pip install -q -e '.[test]' --config-settings editable_mode=compat
	$(VENV)-reference/bin/pip install -q -r tests/reference/requirements.txt
	touch $@

.PHONY: venv-reference
venv-reference: $(VENV)-reference/.installed

test-reference: $(LIBRARY) $(VENV)-reference/.installed
	KRAFLA_ISA=$(ISA) KRAFLA_REFERENCE=1 $(VENV)-reference/bin/python -m pytest -q tests/reference

# --- serve (server): the default model on http://127.0.0.1:8080/v1; e.g. SERVE_ARGS="--port 9000 -t 4"
SERVE_ARGS ?=
serve: lib venv
	$(VENV)/bin/krafla pull smollm2-135m
	$(VENV)/bin/twistd -n --pidfile= krafla $(SERVE_ARGS)

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
