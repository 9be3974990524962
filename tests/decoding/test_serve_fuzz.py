"""Property-based fuzz of every endpoint from the server's own OpenAPI schema (schemathesis):
no request, well-formed or not, gets a 5xx or hangs, and every error is OpenAI's error object.
Bounded in examples per endpoint and mode and in each call's time; the served context is short
so that accepted requests finish quickly."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import models  # noqa: E402
from decoding import Engine  # noqa: E402
from decoding.serve.local import running_server  # noqa: E402

EXAMPLES = 25  # per endpoint and generation mode
CALL_TIMEOUT_S = 30.0
NAME = "code-target"


@pytest.fixture(scope="module")
def api_schema():
    model, tok = models.pretrained(NAME)
    engine = Engine(model, max_batch=8, num_pages=64, page_size=16, max_seq_len=48)
    with running_server(engine, tok, model_name=NAME) as (url, _):
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def _fuzz(path: str, operation, mode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case, served):
        if served and isinstance(case.body, dict):  # past the model and context checks
            case.body["model"] = NAME
            for field in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(field), int):
                    case.body[field] = min(max(case.body[field], 1), 8)
        response = case.call(timeout=CALL_TIMEOUT_S)
        assert response.status_code < 500, (path, case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=str)
def test_no_server_error_and_no_hang(api_schema, mode):
    # Operations driven by hand: schemathesis's pytest plugin does not run on this pytest.
    operations = {op.path: op for op in (r.ok() for r in api_schema.get_all_operations())}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(operations)
    for path, operation in operations.items():
        if mode == schemathesis.GenerationMode.POSITIVE or operation.method.upper() == "POST":
            _fuzz(path, operation, mode)
