"""A real Ray Serve instance on localhost for the serve and batch tests, and the tiny models they use."""
from __future__ import annotations

import functools
import json
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_chat_checkpoint(path: Path) -> Path:
    """k2-tiny's weights beside a byte-level BPE tokenizer (1024 ids, ``</s>`` = 1) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kdray.model.presets import k2_tiny_path

    path.mkdir(parents=True, exist_ok=True)
    src = k2_tiny_path()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, path / name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
                             "kdray serves mixture of experts models on ray"] * 10, trainer)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<x{i}>" for i in range(vocab - tok.get_vocab_size())])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return path


@contextmanager
def deployment_options(**options):
    """Serve deployment options (``Deployment.options``) added to those of every app ``kdray.serve.app`` builds
    meanwhile: for what a test only waits on (a health-check period, constructor retries)."""
    from kdray.serve import server

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server.KdrayServer, "options", functools.partial(server.KdrayServer.options, **options))
        yield


class ServeCluster:
    """Serve on a free localhost port of the running Ray cluster; apps are added by route prefix."""

    def __init__(self):
        from ray import serve

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.apps: dict[str, str] = {}  # route prefix -> app name
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def deploy(self, apps: dict[str, dict], **options) -> str:
        """Run ``{route_prefix: builder args}`` (each under a name of its own, with the Serve ``options`` of
        :func:`deployment_options`) and wait until every one answers ``/health``; return the base URL. A replica
        stopping looks for requests in flight every 0.1 s (Serve's default: 2 s, paid again at the run's end)."""
        from ray import serve

        from kdray.serve import app

        with deployment_options(**{"graceful_shutdown_wait_loop_s": 0.1} | options):
            for prefix, args in apps.items():
                name = self.apps[prefix] = "app-" + (prefix.strip("/").replace("/", "-") or "root")
                serve.run(app(args), name=name, route_prefix=prefix, blocking=False)
        deadline = time.monotonic() + 120
        for prefix in apps:
            while requests.get(f"{self.base}{prefix.rstrip('/')}/health", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, f"the app at {prefix} did not become healthy"
                time.sleep(0.2)
        return self.base

    def shutdown(self):
        from ray import serve

        serve.shutdown()


def metric(base: str, name: str, key: str | None = None) -> float:
    """One unlabelled sample of ``name`` from ``GET /metrics`` (sending ``key`` when the app wants one there)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in requests.get(f"{base}/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
