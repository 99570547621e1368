"""SageMaker's routes, as vLLM serves them: /ping (GET or POST) answers as /health, and POST
/invocations runs its body on the route whose request it is (vLLM's images on SageMaker answer
these two only)."""
from aiohttp import web

from pagedserve.gateway import pooling_routes, routes
from pagedserve.gateway.admission import served_for
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.serving import read_json

# The keys that mark each route's request, the first match winning; `input` is an embeddings or a
# classification request by what the model serves.
_ROUTES = (({"messages"}, routes.chat_completions), ({"prompt"}, routes.completions),
           ({"text_1", "text_2"}, pooling_routes.score), ({"query", "documents"}, pooling_routes.rerank))


async def invocations(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, dict)
    for keys, route in _ROUTES:
        if keys <= body.keys():
            return await route(request)
    if "input" not in body:
        raise bad_request("/invocations runs chat (`messages`), completions (`prompt`), embeddings or "
                          "classification (`input`), score (`text_1`, `text_2`) or rerank (`query`, "
                          "`documents`) requests; the body has none of those fields.")
    model = body.get("model")
    served = await served_for(request, model if isinstance(model, str) else None)
    classifies = "classify" in served.spec.pooling_tasks
    return await (pooling_routes.classify if classifies else pooling_routes.embeddings)(request)
