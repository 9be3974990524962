"""An OpenAI-compatible HTTP server in front of one continuous-batching engine.

``python -m decoding.serve --model smollm2-135m-instruct --port 8000``; ``create_app`` builds the
FastAPI app for an engine and tokenizer (what tests and embedders use). See ``docs/serving.md``.
"""

from decoding.serve.app import create_app

__all__ = ["create_app"]
