"""OpenAI-compatible LLM simulator: deterministic, scriptable answers, judge outputs and failures.

A separate program (`python -m infra.simulator`); it may import `shared.core`, nothing else of
`shared`. Modules: `server` (Simulator, create_app), `script` (Script, SimConfig), `schema`
(fill_schema, find_schema_in_text, excerpt_reply), `from_benchmark` (simulator_script_for).
Nothing is imported here, so loading the script builder does not load the HTTP server.
"""
