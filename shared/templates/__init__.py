"""Layer 2, untrusted user code: `answer` (BaseAnswer, the karenina aliases), `calls` (validate
and verify templates, run callable and regex traits, in the sandbox), `cache` (TemplateInfoCache),
`sandbox` (the worker pool, parent side), `protocol` (frames and what a worker may run, shared by
both sides) and the worker side: `jail` (its entry point), `confine` (rlimits, uid drop, seccomp,
Landlock, audit hook) and `zygote` (forks the call processes).

Nothing is imported here: sandbox workers import only what they run.
"""
