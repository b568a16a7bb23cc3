"""Old import path of `shared.core.benchmark` (documented API), kept as a re-export."""

from shared.core.benchmark import Benchmark, BenchmarkError, Question, first_words

__all__ = ["Benchmark", "BenchmarkError", "Question", "first_words"]
