"""veribus's shared library, in layers (lowest first; a module imports only its own layer or
one listed before it, see notes/HOUSE.md):

1. `shared.core`      pure domain, no I/O
2. `shared.templates` untrusted user code (answer templates, callable traits) and its sandbox
2. `shared.runtime`   what a running service needs (bus, harness, run control, LLM, MCP, search)
3. `shared.store`     ClickHouse: engine, rows, projection, reads
4. `shared.analysis`  result sets, statistics, gates, exports, reports
5. `shared.control`   run control from outside: plan/submit/wait, stack, lifecycle, rebuild, status
6. `shared.cli`       the `veribus` command

`shared.benchmark`, `shared.config`, `shared.models`, `shared.runner` and `shared.results` are
the older documented import paths, kept as re-exports.
"""
