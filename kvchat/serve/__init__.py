"""``kvchat serve``: an OpenAI-compatible HTTP server (and Anthropic's Messages API, translated
to the same chat requests by ``anthropic``) on the same engine, pool and store.

``schema`` validates requests, ``matching`` finds the session a request
continues (by name or by the longest shared token prefix), ``worker`` runs
requests on threads whose replies decode together in the model's generation
core, ``app`` holds the routes. Nothing in the engine knows this front end exists.
"""

from .app import DEFAULT_MAX_BODY, create_app
from .worker import Engine

__all__ = ["DEFAULT_MAX_BODY", "Engine", "create_app"]
