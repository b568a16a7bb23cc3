"""Benchmarks: `model` (Benchmark: load, save, validate), `question` (Question, BenchmarkError),
the readers `jsonld` (reference checkpoints) and `plain` (our YAML/JSON, the reference's CSV),
and `checks` (compile checks; no user code is executed while loading)."""

from shared.core.benchmark.model import Benchmark
from shared.core.benchmark.question import BenchmarkError, Question, first_words

__all__ = ["Benchmark", "BenchmarkError", "Question", "first_words"]
