"""Layer 5, run control from outside the services: `runner` (plan_run, submit, collect),
`wait` (wait for finalized results), `stack` (the local stack; its `processes` and `nats_nodes`),
`lifecycle` (cancel, resume, regrade), `rebuild` (projections), `status` (a run's problems),
`streams` (a run's history read back from the stream)."""
