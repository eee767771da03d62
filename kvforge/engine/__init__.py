"""Request state, scheduling, the KV cache manager and the engine loop."""
