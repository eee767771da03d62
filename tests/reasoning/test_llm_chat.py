"""LLM(reasoning_parser=...).chat on a tiny model scripted to reply `<think>The quick fox</think>Paris`: a JSON
schema constrains the answer after the reasoning, which the model wrote freely (jsonschema checks the answer)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from kvforge.llm import LLM
from kvforge.reasoning.registry import reasoning_parser
from kvforge.sampling_params import SamplingParams
from tests.scripted_model import save_scripted_model

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}}, "required": ["city"]}


def test_chat_constrains_the_answer_after_the_reasoning(tmp_path: Path) -> None:
    save_scripted_model(tmp_path, "<think>The quick fox</think>Paris")
    llm = LLM(str(tmp_path), reasoning_parser="deepseek_r1", dtype="float32", kv_cache_memory="16MiB",
              enforce_eager=True)
    try:
        params = SamplingParams(max_tokens=32, temperature=0, guided_json=CITY)
        (output,) = llm.chat([{"role": "user", "content": "Where?"}], params)
        split = reasoning_parser("deepseek_r1").split(output.outputs[0].text, finished=True)
        assert split.reasoning == "The quick fox"
        jsonschema.validate(json.loads(split.content), CITY)
        assert params.structured_output.starts_after is None  # the caller's params are left as they were
    finally:
        llm.shutdown()
