"""The aiohttp application: routes and middlewares."""
from aiohttp import web

from gateway import routes
from gateway.engine_client import EngineClient
from gateway.errors import MAX_BODY_BYTES, error_middleware
from gateway.request_id import request_id_middleware
from gateway.routes import GATEWAY, Gateway
from gateway.tokenizer import Tokenizer


async def _close_engine(app: web.Application) -> None:
    await app[GATEWAY].engine.close()


def build_app(tokenizer: Tokenizer, scheduler_address: str,
              served_model_name: str | None = None) -> web.Application:
    """The gateway app; serve it with handler_cancellation=True (see gateway.server.start)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[request_id_middleware, error_middleware])
    app[GATEWAY] = Gateway(EngineClient(scheduler_address), tokenizer, served_model_name)
    app.on_cleanup.append(_close_engine)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/v1/models", routes.list_models)
    app.router.add_get("/v1/models/{model:.+}", routes.get_model)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    return app
