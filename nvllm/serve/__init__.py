"""`nvllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the AsyncLLMEngine."""

from nvllm.serve.api_server import ServerConfig, build_app, run_server

__all__ = ["ServerConfig", "build_app", "run_server"]
