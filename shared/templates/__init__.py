"""Layer 2, untrusted user code: `answer` (BaseAnswer, the karenina aliases), `calls` (validate
and verify templates, run callable and regex traits, in the sandbox), `cache` (TemplateInfoCache),
`sandbox` (the worker pool, parent side) and `jail` (the worker side: limits, isolation).

Nothing is imported here: sandbox workers import only what they run.
"""
