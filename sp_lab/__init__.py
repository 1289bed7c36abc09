"""The lab beside the product: tiny models, single-device reference forwards, toy families, benchmarks' helpers.

Tests, benchmarks and the GPU suite import it; `sp_runtime` and `nodes` never do (tests/unit/test_layering.py).
"""
