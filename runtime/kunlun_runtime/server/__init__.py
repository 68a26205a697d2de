"""The OpenAI-compatible HTTP server of the runtime (``kunlun-runtime serve``).

``app.create_app`` builds the FastAPI application; ``async_engine.AsyncEngine`` drives the engine
in its own thread; ``protocol``/``responses`` are the request and response bodies; ``lifecycle``
owns loading, readiness and draining, ``watchdog`` the engine-progress bound behind ``/health``;
``door`` refuses unauthenticated or oversized requests before their body is read, ``auth`` maps API
keys to tenants (each its own prefix-cache namespace) and ``fair_share`` bounds each tenant's share
of the waiting queue; ``cli`` defines the ``serve`` subcommand. Metrics live in
``kunlun_runtime.server.metrics``. The server talks to the engine only through ``LLMEngine``'s API.
"""
