"""OpenAI-compatible HTTP server: ``infer serve``.

``app.create_app(engine, served_model_name, api_key)`` builds the FastAPI app; one background
thread (``engine_loop.EngineService``) steps the engine and streams each request's progress back
to its HTTP handler. Nothing heavy is imported here so ``infer --help`` stays fast.
"""
