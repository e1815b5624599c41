# Two commands that work on a fresh machine from nothing:
#   make test   the test suite; Triton kernels run on the CPU through the interpreter; then the
#               wheel as pip installs it (test-wheel) and the newest Triton (test-triton-newest)
#   make run    the main job: on a GPU the benchmark suite; without one every op's
#               self-check through the interpreter and the per-op byte budget
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's CPU build first, so that pip takes it rather than the CUDA wheels; the Triton the GPU machines run
BASE := torch==2.13.0 triton==3.6.0 "numpy<2.3"
# the newest Triton on PyPI (torch 2.13's CUDA wheels pin 3.7.1; its CPU build runs the interpreter of any)
NEWEST := torch==2.13.0 triton==3.9.0 numpy==2.4.6
# one quick test an op file (each op forward and backward), through the newest Triton's interpreter (it
# refuses masks that 3.6's took)
NEWEST_TESTS := tests/ops/test_activation.py::test_matches_reference \
	tests/ops/test_adamw.py::test_kernel_matches_reference \
	tests/ops/test_attention.py::test_bshd_and_non_contiguous \
	tests/ops/test_attention.py::test_tensor_descriptor_loads_match_pointer_tiles \
	tests/ops/test_cross_entropy.py::test_rows_not_aligned_to_16_bytes \
	tests/ops/test_decode_attention.py::test_different_lengths_per_sequence \
	tests/ops/test_decode_linear.py::test_gated_matches_reference \
	tests/ops/test_kv_cache.py::test_append_with_rope_matches_rope_then_append \
	tests/ops/test_linear_cross_entropy.py::test_frozen_head_and_no_bias \
	tests/ops/test_lora.py::test_matches_reference \
	tests/ops/test_moe.py::test_strided_inputs \
	tests/ops/test_norm.py::test_non_contiguous_input \
	tests/ops/test_rope.py::test_position_ids_gather_table_rows \
	tests/ops/test_softmax.py::test_causal
DIST := build/dist
WHEEL_VENV := build/wheel-venv
NEWEST_VENV := build/triton-newest-venv

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(BASE)
	$(PY) -m pip uninstall -q -y onepass 2>/dev/null  # the distribution's name before onepass-kernels
	$(PY) -m pip install -q -c constraints.txt -e ".[test,hf,plots]"  # plots: the sweep heatmaps' test
	touch $@

.PHONY: test test-wheel test-triton-newest run
test: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples .ci
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto
	# side by side: each is mostly one process (pip, the interpreter), and on CI's 2 cores together they take
	# about the longer one's time; each one's output comes whole when it ends
	$(MAKE) -j2 --output-sync=target test-wheel test-triton-newest

# what `pip install onepass-kernels` gets: the wheel and sdist that `python -m build` makes (the wheel
# built from the sdist), the wheel installed in a fresh environment beside torch and Triton alone (no
# transformers: the hf extra), run from outside the source tree
test-wheel: $(VENV)/.installed
	rm -rf $(DIST) $(WHEEL_VENV)
	$(PY) -m build -q --outdir $(DIST) . > /dev/null
	$(PY) .ci/check_dist.py $(DIST)
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q $(BASE)
	$(WHEEL_VENV)/bin/pip install -q $(DIST)/*.whl
	cd $(WHEEL_VENV) && bin/python -c "import onepass; assert 'site-packages' in onepass.__file__, onepass.__file__"
	cd $(WHEEL_VENV) && bin/onepass --version && bin/onepass selfcheck

test-triton-newest: $(VENV)/.installed
	rm -rf $(NEWEST_VENV)
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install -q $(NEWEST)
	$(NEWEST_VENV)/bin/pip install -q -c constraints.txt pytest
	PYTHONPATH=src $(NEWEST_VENV)/bin/python -m onepass selfcheck
	PYTHONPATH=src TRITON_INTERPRET=1 $(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(NEWEST_TESTS)

run: $(VENV)/.installed
	$(PY) -m onepass.cli run
