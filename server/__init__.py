"""The OpenAI-compatible HTTP server: `create_app(engine_cfg, server_cfg)` and `serve(...)`."""
from server.app import create_app
from server.serve import serve

__all__ = ["create_app", "serve"]
