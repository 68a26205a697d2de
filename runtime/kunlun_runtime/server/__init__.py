"""The OpenAI-compatible HTTP server of the runtime (``kunlun-runtime serve``).

``app.create_app`` builds the FastAPI application; ``async_engine.AsyncEngine`` drives the engine
in its own thread and is the one door to it: nothing else in the server holds the ``LLMEngine``
(``engine_facts`` is what it reads of it once loaded; ``request_stream`` what a request hands it
and gets back). ``chat`` and ``completions`` serve the routes from ``served_model`` (the model,
its limits, its tokenizer off the event loop), ``request_building`` (a body to engine requests
and queue places) and ``streaming`` (a whole answer or server-sent events);
``protocol``/``responses`` are the request and response bodies; ``lifecycle`` owns loading,
readiness and draining, ``watchdog`` the engine-progress bound behind ``/health``; ``door``
refuses unauthenticated or oversized requests before their body is read, ``auth`` maps API keys
to tenants (each its own prefix-cache namespace) and ``fair_share`` bounds each tenant's share of
the waiting queue; ``cli`` defines the ``serve`` subcommand; ``metrics`` and ``stats`` are the
Prometheus metrics and what feeds them after each step.
"""
