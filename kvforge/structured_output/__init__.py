"""Constrained decoding: JSON schemas, regexes, choices and grammars as per-request token bitmasks."""
