"""Layer 2, what a running service needs: `bus` (NATS connection, stream, publish), `harness`
(StageService: durable consumer, publish-then-ack, give-up path), `runcontrol` (RunControl:
cancel and token budget per message), `limits` (deployment-wide model limits: `ledger`,
`ledger_store`, `call_limits`), `llm` (LLMClient), `mcp` (MCP tool pool), `search`
(the deep-judgment search tool)."""
