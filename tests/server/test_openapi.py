"""The served OpenAPI document says what the server answers, and schema fuzzing against it finds no
server error and no undocumented status code, content type or body.

The fuzzed server has a small context (32 tokens) and 4 batch slots + a queue of 4, so that every
generated request is quick to serve (or to refuse) on a CPU; each operation gets a bounded number of
examples. The pooling routes are fuzzed against a tiny pooling model's server of the same size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.harness import ServerThread, start_tiny_server
from tests.server.test_errors import AUTH
from tests.tiny_models import save_model

ERROR_REF = "#/components/schemas/ErrorResponse"
EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_tiny_server(tiny_model_dir, max_queue=4, max_num_seqs=4, max_model_len=32)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def document(fuzzed_server: ServerThread) -> dict:
    return _document(fuzzed_server)


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory) -> Iterator[ServerThread]:
    """A tiny Qwen3 reranker (a classifier head): it embeds, classifies and scores."""
    folder = tmp_path_factory.mktemp("fuzzed-reranker")
    save_model(folder, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["Ġthe", "is"])
    (folder / "config.json").write_text(json.dumps(config))
    server = start_tiny_server(folder, max_queue=4, max_num_seqs=4, max_model_len=32)
    yield server
    server.stop()


def _document(server: ServerThread) -> dict:
    response = server.http.get("/openapi.json", headers=AUTH)
    assert response.status_code == 200
    return response.json()


def _error_ref(response: dict) -> str:
    return response["content"]["application/json"]["schema"]["$ref"]


def test_the_document_lists_the_real_responses(document: dict) -> None:
    assert "422" not in str(document) and "HTTPValidationError" not in document["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "408", "413", "503"}
        assert all(_error_ref(responses[s]) == ERROR_REF for s in responses if s != "200")
        assert "Retry-After" in responses["503"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for path in ("/tokenize", "/detokenize"):
        assert set(document["paths"][path]["post"]["responses"]) == {"200", "400", "401", "404", "408", "413", "503"}
    assert set(document["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401"}
    assert set(document["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404"}
    assert set(document["paths"]["/version"]["get"]["responses"]) == {"200"}
    assert set(document["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    assert set(document["paths"]["/ready"]["get"]["responses"]) == {"200", "503"}
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    error = document["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["$ref"] == "#/components/schemas/ErrorInfo"


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Bodies that fit the schema, and bodies that break it; the GET routes take no input to break.
CASES = [("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
         ("POST", "/v1/chat/completions", POSITIVE), ("POST", "/v1/chat/completions", NEGATIVE),
         ("POST", "/tokenize", POSITIVE), ("POST", "/tokenize", NEGATIVE),
         ("POST", "/detokenize", POSITIVE), ("POST", "/detokenize", NEGATIVE),
         ("GET", "/v1/models", POSITIVE), ("GET", "/v1/models/{model_id}", POSITIVE), ("GET", "/version", POSITIVE),
         ("GET", "/health", POSITIVE), ("GET", "/ready", POSITIVE), ("GET", "/metrics", POSITIVE)]
# The pooling routes (/v1/rerank and /v2/rerank are /rerank's handler), fewer examples each: their bodies are small.
POOLING_CASES = [(path, mode) for path in ("/v1/embeddings", "/score", "/rerank", "/classify")
                 for mode in (POSITIVE, NEGATIVE)]
POOLING_EXAMPLES_PER_OPERATION = 20
STATUSES: dict[int, int] = {}  # every answer the fuzzing got, by status


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=lambda v: getattr(v, "value", v))
def test_fuzzed_requests_get_documented_answers(document: dict, fuzzed_server: ServerThread, method: str,
                                                path: str, mode: GenerationMode) -> None:
    """Requests generated from the document (valid ones, and ones that break it), each answered with
    a documented status, content type and body; never a 5xx."""
    _fuzz(document, fuzzed_server, method, path, mode, EXAMPLES_PER_OPERATION)


@pytest.mark.parametrize(("path", "mode"), POOLING_CASES, ids=lambda v: getattr(v, "value", v))
def test_fuzzed_pooling_requests_get_documented_answers(pooling_server: ServerThread, path: str,
                                                        mode: GenerationMode) -> None:
    """The same of the pooling routes, served by a pooling model."""
    _fuzz(_document(pooling_server), pooling_server, "POST", path, mode, POOLING_EXAMPLES_PER_OPERATION)


def _fuzz(document: dict, server: ServerThread, method: str, path: str, mode: GenerationMode,
          max_examples: int) -> None:
    operation = schemathesis.openapi.from_dict(document)[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(base_url=server.base_url, headers=AUTH, timeout=60)
        STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance])

    check()
    assert server.http.get("/health").status_code == 200


def test_the_fuzzing_reached_the_model(fuzzed_server: ServerThread) -> None:
    """Not only refusals: many generated requests were served (200), and none failed on the server."""
    print(f"fuzzed answers by status: {dict(sorted(STATUSES.items()))}")
    assert STATUSES.get(200, 0) >= EXAMPLES_PER_OPERATION and STATUSES.get(400, 0) >= EXAMPLES_PER_OPERATION
    assert not [status for status in STATUSES if status >= 500]
