"""The Ray Serve application: a FastAPI ingress on a deployment that owns one engine per replica.

``serve run kdray.serve:app`` serves the default model; ``serve run kdray.serve:app model=<path>
drafter=<path> tp=<n> budget=<n>`` (or a Serve config YAML's ``args``) serves another. Replicas
scale with Serve's ``autoscaling_config``.

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` annotations.
"""
import asyncio
import hmac
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application

from kdray import __version__
from kdray.llm import LLM
from kdray.serve.args import ServeArgs
from kdray.serve.async_engine import AsyncEngine, EngineDead, QueueFull
from kdray.serve.batch import BatchStore, parse_upload
from kdray.serve.metrics import Metrics
from kdray.serve.protocol import APIError, parse_json
from kdray.serve.serving import OpenAIServing

logger = logging.getLogger("kdray.serve")
api = FastAPI(title="kdray", description="OpenAI-compatible API over the kdray engine")


def _default_device() -> str:
    import ray
    import torch

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    return "cuda" if gpus or torch.cuda.is_available() else "cpu"


def app(args: dict[str, Any]) -> Application:
    """Serve application builder: ``args`` are :class:`ServeArgs` fields."""
    a = ServeArgs.parse(args or {})
    a = replace(a, device=a.device or _default_device())
    gpus = 1 if a.device != "cpu" and a.tp == 1 else 0  # with tp > 1 the shard actors hold the GPUs
    options: dict[str, Any] = {"max_ongoing_requests": a.max_ongoing_requests,
                               "ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}}
    if a.autoscaling_config:
        options["autoscaling_config"] = a.autoscaling_config
    else:
        options["num_replicas"] = a.num_replicas
    return KdrayServer.options(**options).bind(replace(a, api_key=a.api_key or os.environ.get("KDRAY_API_KEY")))


def _api_error(e: Exception, route: str) -> APIError:
    """The HTTP error for an exception raised while handling ``route``."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_dead")
    logger.exception("%s failed", route)
    return APIError(500, f"internal error: {e!r}", code="internal_error")


# Serve pickles the class when it is decorated: everything its methods use must be defined above.
@serve.deployment
@serve.ingress(api)
class KdrayServer:
    """One engine per replica; routes only translate HTTP to :class:`OpenAIServing` and back."""

    async def __init__(self, args: ServeArgs):
        self.llm = await asyncio.to_thread(LLM, **args.engine_kwargs())
        self.metrics = Metrics()
        self.engine = AsyncEngine(self.llm.engine, args.max_num_seqs, args.max_queue, self.metrics)
        self.openai = OpenAIServing(self.engine, args.served_model_name or args.model)
        self.api_key = args.api_key
        self.batches = BatchStore(args.batch_dir, self._send_batch_request, args.max_num_seqs)
        self.batches.start()

    def check_health(self):
        """Serve's health check: the engine thread must be alive."""
        self.engine.check()

    async def __del__(self):
        """Serve's shutdown hook: stop the batch jobs (they resume elsewhere), the engine thread, the actors."""
        await self.batches.close()
        self.engine.shutdown()
        self.llm.shutdown()

    async def _send_batch_request(self, url: str, body: dict) -> tuple[int, dict]:
        """A batch line's answer; a full queue waits, a dead engine stops the job (another replica resumes it)."""
        while True:
            try:
                return await self.openai.respond(url, body)
            except QueueFull as e:
                await asyncio.sleep(e.retry_after)
            except EngineDead:
                raise
            except Exception as e:  # noqa: BLE001 - recorded as the line's 500, like an HTTP answer
                err = _api_error(e, url)
                return err.status, err.body()

    async def _handle(self, request: Request, route: str, handler: Callable[[], Any]) -> Response:
        """Authorise, run ``handler``, turn its result (or error) into a response, count it."""
        try:
            if route.startswith("/v1/"):
                self._authorize(request)
            result = handler()
            if inspect.isawaitable(result):
                result = await result
            if isinstance(result, Response):
                response = result
            elif isinstance(result, AsyncIterator):
                response = StreamingResponse(result, media_type="text/event-stream")
            else:
                response = JSONResponse(result)
        except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-style body; the server keeps serving
            err = _api_error(e, route)
            response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    def _authorize(self, request: Request):
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _health(self) -> dict:
        self.engine.check()
        return {"status": "ok", "model": self.openai.model_name}

    async def _upload(self, request: Request) -> dict:
        fields, file = parse_upload(request.headers.get("content-type", ""), await request.body())
        if file is None:
            raise APIError(400, "file: missing; send the JSONL as the multipart field 'file'", param="file")
        return self.batches.create_file(file[1], Path(file[0]).name, fields.get("purpose", ""))

    @staticmethod
    async def _json(request: Request, handler: Callable[[dict], Any]) -> Any:
        result = handler(parse_json(await request.body()))
        return await result if inspect.isawaitable(result) else result

    @api.get("/health")
    async def health(self, request: Request):
        return await self._handle(request, "/health", self._health)

    @api.get("/metrics")
    async def metrics_text(self, request: Request):
        return await self._handle(request, "/metrics",
                                  lambda: Response(self.metrics.render(), media_type=Metrics.CONTENT_TYPE))

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self._handle(request, "/v1/models", self.openai.models)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "/v1/completions", lambda: self._json(request, self.openai.completions))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, "/v1/chat/completions", lambda: self._json(request, self.openai.chat))

    @api.post("/v1/files")
    async def create_file(self, request: Request):
        return await self._handle(request, "/v1/files", lambda: self._upload(request))

    @api.get("/v1/files/{file_id}")
    async def get_file(self, request: Request, file_id: str):
        return await self._handle(request, "/v1/files/{id}", lambda: self.batches.get_file(file_id))

    @api.get("/v1/files/{file_id}/content")
    async def file_content(self, request: Request, file_id: str):
        return await self._handle(request, "/v1/files/{id}/content", lambda: Response(
            self.batches.file_path(file_id).read_bytes(), media_type="application/jsonl"))

    @api.post("/v1/batches")
    async def create_batch(self, request: Request):
        return await self._handle(request, "/v1/batches", lambda: self._json(request, self.batches.create_batch))

    @api.get("/v1/batches")
    async def list_batches(self, request: Request, limit: int = 20):
        return await self._handle(request, "/v1/batches", lambda: self.batches.list_batches(limit))

    @api.get("/v1/batches/{batch_id}")
    async def get_batch(self, request: Request, batch_id: str):
        return await self._handle(request, "/v1/batches/{id}", lambda: self.batches.get_batch(batch_id))

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, request: Request, batch_id: str):
        return await self._handle(request, "/v1/batches/{id}/cancel", lambda: self.batches.cancel_batch(batch_id))

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._handle(request, "/tokenize", lambda: self._json(request, self.openai.tokenize))

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._handle(request, "/detokenize", lambda: self._json(request, self.openai.detokenize))

    @api.get("/version")
    async def version(self, request: Request):
        return await self._handle(request, "/version", lambda: {"version": __version__})
