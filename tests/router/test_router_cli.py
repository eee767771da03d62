"""Bad input to `kvforge router` and `kvforge serve --data-parallel-size` (either backend): one line and exit
code 2, before anything starts; and the text a request is routed by."""

from __future__ import annotations

import pytest

from kvforge.cli import main
from kvforge.router.request_text import routing_text


@pytest.mark.parametrize("argv, message", [
    (["router", "--backend", "localhost:8000"], "a backend is a base URL such as http://host:8000, got 'localhost"),
    (["router", "--backend", "http://a:1", "--backend", "http://a:1"], "a backend is given twice"),
    (["router", "--backend", "http://a:1", "--health-interval", "0"], "health_interval must be > 0 seconds, got 0"),
    (["router", "--backend", "http://a:1", "--route-max-kv-usage", "2"], "max_kv_cache_usage must be in (0, 1]"),
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["serve", "--data-parallel-size", "2", "--block-size", "3"], "block_size must be a power of two"),
    (["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray", "--data-parallel-replica-cpus", "0"],
     "--data-parallel-replica-cpus must be >= 1, got 0"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_text_a_request_is_routed_by() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}]}
    assert routing_text("/v1/chat/completions", chat) == "<system>Be brief.\n<user>Hi"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_text("/v1/completions", {"prompt": [[5, 6, 7], [8]]}) == "5 6 7"
    assert routing_text("/v1/embeddings", {"input": "text"}) == "text"
    with pytest.raises(ValueError, match="the request body must be a JSON object, got list"):
        routing_text("/v1/completions", [1, 2])
