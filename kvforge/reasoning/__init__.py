"""Reasoning parsers: a reply's reasoning (between <think> tags) apart from its content."""
