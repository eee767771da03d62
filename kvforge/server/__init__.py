"""The OpenAI-compatible HTTP server: protocol models, routes, metrics and the `kvforge serve` command."""
