"""`iquestrt serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one `LLM`."""
