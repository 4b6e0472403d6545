"""The HTTP server (``metainfer-gen serve``): OpenAI's completions and chat API over the LLM engine.

Modules: ``async_engine`` (the engine thread), ``streams`` (per-request event queues), ``protocol`` (request
checks), ``generation`` (one request, whole or streamed), ``responses`` (OpenAI bodies and SSE chunks), ``chat``
(chat templates), ``http_io`` (body limit, API key, disconnects), ``metrics`` (Prometheus, vLLM's names), ``app``
(the FastAPI routes), ``server`` (load + uvicorn). Needs the ``serve`` extra: ``pip install 'metainfer-gen[serve]'``.
Importing this package imports nothing heavy.
"""
