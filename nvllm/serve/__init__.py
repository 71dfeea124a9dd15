"""`nvllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the AsyncLLMEngine.

The package itself imports nothing: commands that never serve (`nvllm quantize`, `generate`, `eval`) start without
loading FastAPI and uvicorn. Import `nvllm.serve.api_server` for `build_app`, `run_server` and `ServerConfig`."""
