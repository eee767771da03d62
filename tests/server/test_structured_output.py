"""Structured output through the official `openai` client against the served default model: every output
validates with the `jsonschema` package (a reference nobody here wrote), whatever the model would say."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import jsonschema
import openai
from pydantic import BaseModel, Field

from tests.server.harness import MODEL_NAME


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=12)
    address: Address


class Primes(BaseModel):  # an array with minItems
    primes: list[int] = Field(min_length=3, max_length=4)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):  # enums
    color: Color
    finish: Literal["matte", "gloss"]


class Rating(BaseModel):  # numbers with bounds
    stars: int = Field(ge=1, le=5)
    price: int = Field(ge=0, le=999)


class Flight(BaseModel):  # a string with a pattern
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")


CASES = [(Person, "Describe a person who lives in Paris."), (Primes, "List the first prime numbers."),
         (Paint, "Pick a paint for a kitchen."), (Rating, "Rate a cheap hotel."),
         (Flight, "Give the code of a flight to Rome.")]


def _parse(client: openai.OpenAI, model: type[BaseModel], prompt: str) -> tuple[BaseModel, str]:
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                               response_format=model, max_tokens=48, temperature=0)
    message = completion.choices[0].message
    return message.parsed, message.content


def test_parse_returns_objects_that_validate(default_client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(CASES)) as pool:  # one batch of differently constrained requests
        results = list(pool.map(lambda case: _parse(default_client, *case), CASES))
    for (model, _), (parsed, content) in zip(CASES, results):
        assert isinstance(parsed, model)
        jsonschema.validate(json.loads(content), model.model_json_schema())


def test_json_object_regex_and_choice_always_hold(default_client: openai.OpenAI) -> None:
    def chat(prompt: str, **extra: object) -> list[str]:
        response = default_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], seed=5, **extra)
        assert all(c.finish_reason == "stop" for c in response.choices)
        return [c.message.content for c in response.choices]

    sampled = {"max_tokens": 12, "temperature": 1.0, "n": 3}
    jobs = [("Reply in JSON: what is a cat's name?", {"response_format": {"type": "json_object"},
                                                    "max_tokens": 40, "temperature": 0}),
            ("What time is it?", {"extra_body": {"guided_regex": r"[0-2][0-9]:[0-5][0-9]"}, **sampled}),
            ("Is water wet?", {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}, **sampled})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        objects, times, answers = pool.map(lambda job: chat(job[0], **job[1]), jobs)
    assert all(isinstance(json.loads(text), dict) for text in objects)
    assert all(re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", text) for text in times)
    assert all(text in ("yes", "no", "maybe") for text in answers)


def test_max_tokens_cutting_a_constrained_output_is_length(default_client: openai.OpenAI) -> None:
    response = default_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=3,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema(), "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 3
    assert choice.message.content.startswith("{")
