"""The OpenAI-compatible HTTP server of the runtime (``kunlun-runtime serve``).

``app.create_app`` builds the FastAPI application; ``async_engine.AsyncEngine`` drives the engine
in its own thread; ``protocol``/``responses`` are the request and response bodies; ``lifecycle``
owns loading, readiness and draining; ``cli`` registers the ``serve`` subcommand. Metrics live in
``kunlun_runtime.metrics``. The server talks to the engine only through ``LLMEngine``'s API.
"""
