"""Benchmark placeholder (filled in by the benchmark harness)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    print("bench: not available yet; see benchmarks/")
    return 2
