"""``ServeArgs``: what ``serve run kdray.serve:app key=value ...`` (or a Serve config YAML's ``args``, or
``kdray serve``'s flags) may set: every :class:`~kdray.engine.args.EngineArgs` field plus the server's own."""
from __future__ import annotations

from dataclasses import dataclass, fields

from pydantic import ConfigDict, TypeAdapter, ValidationError

from kdray.engine.args import EngineArgs, setting


@dataclass(kw_only=True)
class ServeArgs(EngineArgs):
    # Values arrive as strings from the command line (``tp=2``); pydantic converts them, and refuses unknown keys.
    __pydantic_config__ = ConfigDict(extra="forbid")

    served_model_name: str | None = setting("the name clients send as 'model' (default: the model argument)",
                                          default=None)
    max_queue: int = setting("requests waiting beyond max_num_seqs before 503s", default=256)
    api_key: str | None = setting("require this bearer key (default: $KDRAY_API_KEY)", default=None)
    protect_metrics: bool = setting("require the API key on GET /metrics too", default=False)
    max_request_bytes: int = setting("largest JSON request body; larger ones get 413", default=8 << 20)
    max_file_bytes: int = setting("largest upload to POST /v1/files; larger ones get 413", default=100 << 20)
    batch_dir: str = setting("where /v1/files and /v1/batches keep their data (created on first use; storage "
                             "every node mounts when there are several)", default="~/.cache/kdray/batches")
    batch_retention_days: float | None = setting("delete finished batches and uploads this many days after they "
                                                 "end (none: keep them)", default=30.0)
    num_replicas: int = setting("engines, one per replica", default=1)
    autoscaling_config: dict | None = setting("Serve's AutoscalingConfig; replaces num_replicas", default=None)
    max_ongoing_requests: int = setting("requests one replica takes at once (Serve's bound)", default=1024)

    def __post_init__(self):
        super().__post_init__()
        for name, low in (("max_queue", 0), ("num_replicas", 1), ("max_ongoing_requests", 1),
                          ("max_request_bytes", 1024), ("max_file_bytes", 1024)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")
        if self.batch_retention_days is not None and not self.batch_retention_days > 0:
            raise ValueError(f"batch_retention_days={self.batch_retention_days} must be > 0 (or none to keep "
                             "everything)")

    @classmethod
    def parse(cls, raw: dict) -> ServeArgs:
        """Validate builder arguments (strings convert to the fields' types); a bad one raises ``ValueError``
        naming it."""
        try:
            return TypeAdapter(cls).validate_python(raw)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'args'}: {err['msg']}" for err in e.errors())
            raise ValueError(f"kdray.serve:app arguments: {problems} (the arguments are kdray.serve.ServeArgs "
                             "fields)") from None

    def engine_kwargs(self) -> dict:
        """The :class:`EngineArgs` part, as ``LLM`` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(EngineArgs)}
