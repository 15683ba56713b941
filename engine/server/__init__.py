"""The OpenAI-compatible HTTP server: `create_app(engine_cfg, server_cfg)` and `serve(...)`."""
from engine.server.app import create_app
from engine.server.serve import serve

__all__ = ["create_app", "serve"]
