"""The LLM port: `client` (LLMClient.complete), `reply` (LLMReply, LLMError, usage, extract_json),
`cache` (response caches), `transport` (litellm or direct HTTP; error classification)."""

from shared.runtime.llm.cache import CACHE_SCOPE, MemoryCache, NatsKVCache, ResponseCache
from shared.runtime.llm.client import LLMClient
from shared.runtime.llm.reply import LLMError, LLMReply, add_usage, extract_json, usage_entry
from shared.runtime.llm.transport import close_transports

__all__ = [
    "CACHE_SCOPE", "LLMClient", "LLMError", "LLMReply", "MemoryCache", "NatsKVCache", "ResponseCache",
    "add_usage", "close_transports", "extract_json", "usage_entry",
]
