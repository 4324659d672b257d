"""The Ray Serve application: a FastAPI ingress on a deployment that owns one engine per replica.

``serve run kdray.serve:app`` serves the default model; ``serve run kdray.serve:app model=<path>
drafter=<path> tp=<n> budget=<n>`` (or a Serve config YAML's ``args``) serves another. Replicas
scale with Serve's ``autoscaling_config``.

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` annotations.
"""
import asyncio
import hmac
import inspect
import ipaddress
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from kdray import __version__
from kdray.actors.ray_runner import drafter_shares_gpu, engine_bundles
from kdray.llm import LLM
from kdray.model.loader import check_parallel
from kdray.model.presets import PRESETS
from kdray.serve.anthropic import AnthropicServing, error_body
from kdray.serve.args import ServeArgs
from kdray.serve.async_engine import AsyncEngine, EngineDead, QueueFull
from kdray.serve.batch_store import MAX_FILES_LISTED, MAX_LISTED, BatchStore
from kdray.serve.metrics import Metrics
from kdray.serve.protocol import APIError, parse_json
from kdray.serve.serving import OpenAIServing, api_error, respond

logger = logging.getLogger("kdray.serve")
# The docs pages load scripts from a CDN and cannot send the API key: only the schema is served, behind the key.
api = FastAPI(title="kdray", description="OpenAI- and Anthropic-compatible API over the kdray engine", docs_url=None,
              redoc_url=None, openapi_url=None)
BATCH_LINE_TRIES = 3  # a batch line that meets a failing engine runs this many times before it is recorded
REPLICA_CPUS = 1.0  # a replica whose engine runs in its own process
COORDINATOR_CPUS = 0.5  # a replica whose engine's model work runs on actors: it schedules and coordinates
MULTIPART_SLACK = 64 << 10  # bytes of multipart framing and fields allowed beyond max_file_bytes


def _cluster_device() -> str:
    """The device of an app built without one: cuda when the cluster (or this machine) has GPUs now."""
    import ray
    import torch

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    return "cuda" if gpus or torch.cuda.is_available() else "cpu"


def _replica_device() -> str:
    """The device of a replica's engine built without one: cuda when Serve gave the replica (or its placement
    group's bundles) GPUs."""
    import ray
    import torch

    pg = ray.util.get_current_placement_group()
    gpus = sum(b.get("GPU", 0) for b in pg.bundle_specs) if pg is not None else 0
    return "cuda" if gpus or torch.cuda.is_available() else "cpu"


def replica_options(a: ServeArgs) -> dict[str, Any]:
    """Serve options that place one replica: its CPU (and GPU, for an engine in its own process), and for an
    engine on actors their bundles after the replica's own, STRICT_PACK, so that Serve schedules (and the
    autoscaler provisions) the whole gang on one node. Without a device, the bundles follow the GPUs the
    cluster has now (set ``device: cuda`` when GPU nodes join later)."""
    gpu = (a.device or _cluster_device()).startswith("cuda")
    if a.tp == 1 and a.distributed != "ray":
        return {"ray_actor_options": {"num_cpus": REPLICA_CPUS, "num_gpus": 1 if gpu else 0}}
    engine = replace(a, device="cuda" if gpu else "cpu", distributed="ray").resolve()
    bundles, _, _ = engine_bundles(engine, drafter_shares_gpu(engine))
    return {"ray_actor_options": {"num_cpus": COORDINATOR_CPUS, "num_gpus": 0},
            "placement_group_bundles": [{"CPU": COORDINATOR_CPUS}, *bundles],
            "placement_group_strategy": "STRICT_PACK"}


def app(args: dict[str, Any]) -> Application:
    """Serve application builder: ``args`` are :class:`ServeArgs` fields. The TP width is checked against the
    model here when its config is readable on this node (else in the replica, before any actor starts)."""
    a = ServeArgs.parse(args or {})
    if a.model in PRESETS or Path(a.model).expanduser().exists():
        check_parallel(a.model, a.tp, a.expert_parallel)
    options: dict[str, Any] = {"max_ongoing_requests": a.max_ongoing_requests, **replica_options(a)}
    if a.autoscaling_config:
        options["autoscaling_config"] = a.autoscaling_config
    else:
        options["num_replicas"] = a.num_replicas
    return KdrayServer.options(**options).bind(replace(a, api_key=a.api_key or os.environ.get("KDRAY_API_KEY")))


def open_without_key(host: str, api_key: str | None) -> str | None:
    """A warning when Serve listens beyond this machine (``host``) and no API key guards the model."""
    if api_key or host == "localhost" or _loopback(host):
        return None
    return (f"Serve listens on {host} and no API key is set: anyone who can reach this port can use the model; "
            "set api_key (or KDRAY_API_KEY), or listen on 127.0.0.1")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error_response(err: APIError, anthropic: bool = False) -> JSONResponse:
    """``err`` as OpenAI's error body, or (``anthropic``: a Messages API route) as Anthropic's."""
    return JSONResponse(error_body(err) if anthropic else err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """FastAPI's own errors (an unknown route, a wrong method) in the OpenAI shape."""
    what = {404: "no such route", 405: "method not allowed here"}.get(e.status_code, str(e.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return _error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {what}", code=code,
                                    headers=dict(e.headers or {})))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """FastAPI's parameter validation (its 422) as a 400 naming the parameter."""
    err = e.errors()[0]
    name = ".".join(str(part) for part in err["loc"][1:]) or str(err["loc"][0])
    return _error_response(APIError(400, f"{name}: {err['msg']}", param=name, code="invalid_value"))


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _body(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive; more than ``limit`` bytes is a 413 (a declared length is
    checked before anything is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body of {declared} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        yield chunk


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.lstrip("-").isdigit() or not low <= int(raw) <= high:
        raise APIError(400, f"{name}: must be an integer in [{low}, {high}] (got '{raw[:40]}')", param=name,
                       code="invalid_value")
    return int(raw)


# Serve pickles the class when it is decorated: everything its methods use must be defined above.
@serve.deployment
@serve.ingress(api)
class KdrayServer:
    """One engine per replica; routes only translate HTTP to :class:`OpenAIServing` and back."""

    async def __init__(self, args: ServeArgs):
        self.args = args
        self.llm = await asyncio.to_thread(LLM, **(args.engine_kwargs() | {"device": args.device or _replica_device()}))
        context, name = serve.get_replica_context(), args.served_model_name or args.model
        self.metrics = Metrics({"app": context.app_name, "replica": context.replica_id.unique_id, "model": name})
        self.engine = AsyncEngine(self.llm.engine, args.max_num_seqs, args.max_queue, self.metrics)
        self.openai = OpenAIServing(self.engine, name)
        self.anthropic = AnthropicServing(self.openai)
        # what a batch line's url runs, and the shape of its errors
        self.batch_routes = {"/v1/completions": (self.openai.completions, APIError.body),
                             "/v1/chat/completions": (self.openai.chat, APIError.body),
                             "/v1/messages": (self.anthropic.messages, error_body)}
        self.api_key = args.api_key
        self.batches = BatchStore(args.batch_dir, self._send_batch_request, args.max_num_seqs, args.max_file_bytes,
                                  args.batch_retention_days)
        self.batches.start()
        try:
            warning = open_without_key(serve.context._get_global_client().http_config.host, self.api_key)
        except Exception:  # noqa: BLE001 - the warning is a courtesy; Serve's config may be unreadable here
            warning = None
        if warning:
            logger.warning(warning)

    def check_health(self):
        """Serve's health check: the engine thread must be alive (it restarts itself after an error)."""
        self.engine.check()

    async def __del__(self):
        """Serve's shutdown hook: stop the batch jobs (they resume elsewhere), the engine thread, the actors.
        After a failed ``__init__`` only what was made is stopped, so the real error stays the one reported."""
        if hasattr(self, "batches"):
            await self.batches.close()
        if hasattr(self, "engine"):
            self.engine.shutdown()
        if hasattr(self, "llm"):
            self.llm.shutdown()

    async def _send_batch_request(self, url: str, body: dict) -> tuple[int, dict]:
        """A batch line's answer. A full queue waits; an engine failure is retried, then recorded as the line's
        error like any other; a dead engine stops the job (another replica resumes it)."""
        (handler, shape), tries = self.batch_routes[url], 0
        while True:
            try:
                return await respond(handler, body, shape)
            except QueueFull as e:
                await asyncio.sleep(e.retry_after)
            except EngineDead:
                raise
            except Exception as e:  # noqa: BLE001 - recorded as the line's error, like an HTTP answer
                err, tries = api_error(e, url), tries + 1
                if err.status != 503 or tries == BATCH_LINE_TRIES:
                    return err.status, shape(err)

    async def _handle(self, request: Request, route: str, handler: Callable[[], Any], public: bool = False,
                      anthropic: bool = False) -> Response:
        """Authorise (unless ``public``), run ``handler``, turn its result (or error: Anthropic's shape on its
        routes) into a response, count it."""
        try:
            if not public:
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
            response = _error_response(api_error(e, route), anthropic)
        self.metrics.requests.inc(route=route, status=str(response.status_code))
        return response

    def _authorize(self, request: Request):
        """``Authorization: Bearer <key>`` (the scheme in any case), or Anthropic's ``x-api-key: <key>``, when the
        server has a key."""
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _health(self) -> dict:
        self.engine.check()
        return {"status": "ok", "model": self.openai.model_name}

    async def _upload(self, request: Request) -> dict:
        """``POST /v1/files``: a ``multipart/form-data`` body (Starlette's parser) of at most ``max_file_bytes``."""
        if _media_type(request) != "multipart/form-data":
            raise APIError(415, "upload files as multipart/form-data with fields 'file' and 'purpose'",
                           code="unsupported_media_type")
        parser = MultiPartParser(request.headers, _body(request, self.args.max_file_bytes + MULTIPART_SLACK),
                                 max_files=1, max_fields=8)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise APIError(400, f"file: malformed multipart body ({e.message})", param="file") from None
        try:
            file, purpose = form.get("file"), form.get("purpose", "")
            if not isinstance(file, UploadFile):
                raise APIError(400, "file: missing; send the JSONL as the multipart field 'file'", param="file")
            name = Path(file.filename or "upload.jsonl").name
            return await asyncio.to_thread(self.batches.create_file, file.file, name,
                                           purpose if isinstance(purpose, str) else "")
        finally:
            await form.close()

    async def _json(self, request: Request, handler: Callable[[dict], Any]) -> Any:
        """Run ``handler`` on the JSON object the request carries (``application/json``, at most
        ``max_request_bytes``; parsed off the event loop)."""
        if _media_type(request) != "application/json":
            raise APIError(415, f"send the request body as Content-Type: application/json (got "
                           f"'{_media_type(request)[:60] or 'none'}')", code="unsupported_media_type")
        raw = b"".join([chunk async for chunk in _body(request, self.args.max_request_bytes)])
        result = handler(await asyncio.to_thread(parse_json, raw))
        return await result if inspect.isawaitable(result) else result

    @api.get("/health")
    async def health(self, request: Request):
        return await self._handle(request, "/health", self._health, public=True)

    @api.get("/metrics")
    async def metrics_text(self, request: Request):
        return await self._handle(request, "/metrics",
                                  lambda: Response(self.metrics.render(), media_type=Metrics.CONTENT_TYPE),
                                  public=not self.args.protect_metrics)

    @api.get("/openapi.json")
    async def openapi(self, request: Request):
        return await self._handle(request, "/openapi.json", api.openapi)

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self._handle(request, "/v1/models", self.openai.models)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "/v1/completions", lambda: self._json(request, self.openai.completions))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, "/v1/chat/completions", lambda: self._json(request, self.openai.chat))

    @api.post("/v1/messages")
    async def messages(self, request: Request):
        return await self._handle(request, "/v1/messages", lambda: self._json(request, self.anthropic.messages),
                                  anthropic=True)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        return await self._handle(request, "/v1/messages/count_tokens",
                                  lambda: self._json(request, self.anthropic.count_tokens), anthropic=True)

    @api.post("/v1/files")
    async def create_file(self, request: Request):
        return await self._handle(request, "/v1/files", lambda: self._upload(request))

    @api.get("/v1/files")
    async def list_files(self, request: Request):
        return await self._handle(request, "/v1/files", lambda: self.batches.list_files(
            request.query_params.get("purpose"), _query_int(request, "limit", MAX_FILES_LISTED, 1, MAX_FILES_LISTED),
            request.query_params.get("after")))

    @api.get("/v1/files/{file_id}")
    async def get_file(self, request: Request, file_id: str):
        return await self._handle(request, "/v1/files/{id}", lambda: self.batches.get_file(file_id))

    @api.delete("/v1/files/{file_id}")
    async def delete_file(self, request: Request, file_id: str):
        return await self._handle(request, "/v1/files/{id}", lambda: self.batches.delete_file(file_id))

    @api.get("/v1/files/{file_id}/content")
    async def file_content(self, request: Request, file_id: str):
        return await self._handle(request, "/v1/files/{id}/content", lambda: FileResponse(
            self.batches.file_path(file_id), media_type="application/jsonl"))

    @api.post("/v1/batches")
    async def create_batch(self, request: Request):
        return await self._handle(request, "/v1/batches", lambda: self._json(request, self.batches.create_batch))

    @api.get("/v1/batches")
    async def list_batches(self, request: Request):
        return await self._handle(request, "/v1/batches", lambda: self.batches.list_batches(
            _query_int(request, "limit", 20, 1, MAX_LISTED), request.query_params.get("after")))

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
