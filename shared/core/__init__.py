"""Layer 1, the pure domain (no I/O beyond reading a benchmark file).

`ids` (deterministic ids), `events` (the wire envelope and payloads), `models`
(VerificationResult), `config` (VerificationConfig, ModelConfig, Settings), `rubric` (traits),
`prompts`, `fold` (stage state -> VerificationResult), `benchmark` (Benchmark and its readers).
"""
