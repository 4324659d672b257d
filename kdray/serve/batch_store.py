"""Files and batch jobs on the server, under ``batch_dir``: ``files/<id>.jsonl`` with ``files/<id>.json`` (its
metadata), and ``batches/<id>.json``.

A job runs in the replica that created it and resumes in a replica that starts later and finds it unfinished
(a file lock keeps it to one runner). A line that fails is recorded as failed and the job goes on; invalid
lines are reported one by one in the batch's error file; a job whose replicas keep dying before it finishes
a line is failed, so it never crash-loops them. Everything is private to the server's user (directories
0700, files 0600); finished batches and their files are deleted ``retention_days`` after they end.
``batch_dir`` is created on first use, so a missing or unwritable one fails the file and batch routes only.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from kdray.serve.batch import BATCH_URLS, BatchOutput, Send, describe, open_private, parse_batch_input, run_batch
from kdray.serve.protocol import APIError

logger = logging.getLogger("kdray.serve")
FINAL = ("completed", "failed", "cancelled", "expired")
MAX_LISTED = 100  # batches per page of GET /v1/batches (OpenAI's bound)
MAX_FILES_LISTED = 10_000  # files per page of GET /v1/files (OpenAI's bound)
MAX_STALLED_STARTS = 3  # starts in a row without a finished line before a job is failed
SWEEP_INTERVAL_S = 3600.0  # how often the retention sweep runs
_FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")


class BatchStore:
    """Uploaded files and batch jobs kept under ``root``; ``send(url, body)`` answers one request."""

    def __init__(self, root: str | Path, send: Send, concurrency: int, max_file_bytes: int,
                 retention_days: float | None):
        self.root = Path(root).expanduser()
        self.max_file_bytes = max_file_bytes
        self.retention_s = None if retention_days is None else retention_days * 86400
        self._send, self._concurrency = send, concurrency
        self._tasks: dict[str, asyncio.Task] = {}
        self._watcher: asyncio.Task | None = None

    def _dir(self, name: str) -> Path:
        """``root/name``, created (0700) on first use; a failure is an error naming ``batch_dir``."""
        path = self.root / name
        try:
            for d in (self.root, path):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise APIError(500, f"batch_dir '{self.root}' cannot be created ({e.strerror}: {e.filename}); point "
                           "batch_dir at a writable directory that every replica mounts",
                           code="batch_dir_unavailable") from None
        return path

    # files

    def create_file(self, source: BinaryIO, filename: str, purpose: str) -> dict:
        """Store an upload (read from ``source``) of at most ``max_file_bytes``."""
        if purpose != "batch":
            raise APIError(400, f"purpose: '{purpose}' is not supported; upload batch inputs with purpose 'batch'",
                           param="purpose")
        meta = self._new_file(filename, purpose, b"")
        path = self._dir("files") / f"{meta['id']}.jsonl"
        with open_private(path, "wb") as out:
            shutil.copyfileobj(source, out)
        meta["bytes"] = path.stat().st_size
        if meta["bytes"] > self.max_file_bytes:
            self._remove_file(meta["id"])
            raise APIError(413, f"file: {meta['bytes']} bytes exceed the limit of {self.max_file_bytes}",
                           param="file", code="file_too_large")
        _write_json(self._dir("files") / f"{meta['id']}.json", meta)
        return meta

    def list_files(self, purpose: str | None, limit: int, after: str | None) -> dict:
        files = [f for f in self._records("files", "file-*.json") if purpose is None or f["purpose"] == purpose]
        return _page(files, limit, after, "file")

    def get_file(self, file_id: str) -> dict:
        return self._file_meta(file_id)

    def file_path(self, file_id: str) -> Path:
        self._file_meta(file_id)
        return self.root / "files" / f"{file_id}.jsonl"

    def delete_file(self, file_id: str) -> dict:
        """``DELETE /v1/files/{id}``; a file that an unfinished batch reads or writes is kept (409)."""
        self._file_meta(file_id)
        for batch in self._records("batches", "batch_*.json"):
            if batch["status"] not in FINAL and file_id in _files_of(batch):
                raise APIError(409, f"file '{file_id}' belongs to batch '{batch['id']}', which is {batch['status']};"
                               " cancel it or wait until it ends", param="file_id", code="file_in_use")
        self._remove_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def _new_file(self, filename: str, purpose: str, content: bytes) -> dict:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        folder = self._dir("files")
        with open_private(folder / f"{file_id}.jsonl", "wb") as f:
            f.write(content)
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed"}
        _write_json(folder / f"{file_id}.json", meta)
        return meta

    def _remove_file(self, file_id: str):
        for suffix in (".json", ".jsonl"):
            (self.root / "files" / f"{file_id}{suffix}").unlink(missing_ok=True)

    def _file_meta(self, file_id: str) -> dict:
        return self._record("files", _FILE_ID, file_id, "file")

    def _record(self, folder: str, pattern: re.Pattern, record_id: str, kind: str) -> dict:
        """The JSON record ``<folder>/<record_id>.json``; a malformed or unknown id is a 404 naming it."""
        path = self.root / folder / f"{record_id}.json"
        if not pattern.match(record_id) or not path.is_file():
            raise APIError(404, f"{kind} '{record_id}' not found", param=f"{kind}_id", code=f"{kind}_not_found")
        return json.loads(path.read_text())

    def _records(self, folder: str, glob: str) -> list[dict]:
        """Every record in ``folder``, newest first (one deleted meanwhile is skipped)."""
        found = []
        for path in (self.root / folder).glob(glob):
            try:
                found.append(json.loads(path.read_text()))
            except FileNotFoundError:
                continue
        return sorted(found, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    # batches

    async def create_batch(self, data: dict) -> dict:
        """``POST /v1/batches``: validate the input file and start the job. Invalid lines are reported one by
        one in the batch's error file (the first ones in its ``errors``); the valid lines run."""
        file_id, endpoint = data.get("input_file_id"), data.get("endpoint")
        if not isinstance(file_id, str):
            raise APIError(400, "input_file_id: required (the id POST /v1/files returned)", param="input_file_id")
        if endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint: must be one of {', '.join(BATCH_URLS)}", param="endpoint")
        if data.get("completion_window", "24h") != "24h":
            raise APIError(400, "completion_window: only '24h' is supported", param="completion_window")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise APIError(400, "metadata: must be an object of strings", param="metadata")
        path = self.file_path(file_id)
        try:
            requests, invalid = await asyncio.to_thread(lambda: parse_batch_input(path.read_bytes(), endpoint))
        except ValueError as e:
            raise APIError(400, f"input_file_id: {e}", param="input_file_id") from None
        now = int(time.time())
        output = self._new_file("batch_output.jsonl", "batch_output", b"")
        errors = None
        if invalid:
            rows = [{"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": p.custom_id, "response": None,
                     "error": {"code": "invalid_request", "message": p.message, "line": p.line}} for p in invalid]
            errors = self._new_file("batch_errors.jsonl", "batch_output",
                                    "".join(json.dumps(r) + "\n" for r in rows).encode())
        batch = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint,
                 "errors": {"object": "list", "data": [
                     {"code": "invalid_request", "message": p.message, "param": None, "line": p.line}
                     for p in invalid[:MAX_LISTED]]} if invalid else None,
                 "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                 "output_file_id": output["id"], "error_file_id": errors["id"] if errors else None,
                 "created_at": now, "in_progress_at": None, "expires_at": now + 24 * 3600, "finalizing_at": None,
                 "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                 "cancelled_at": None,
                 "request_counts": {"total": len(requests) + len(invalid), "completed": 0, "failed": len(invalid)},
                 "metadata": data.get("metadata")}
        if invalid:
            logger.info("batch %s: %d invalid line(s) reported in its error file: %s", batch["id"], len(invalid),
                        describe(invalid))
        self._save(batch)
        self._start(batch["id"])
        return batch

    def get_batch(self, batch_id: str) -> dict:
        return self._record("batches", _BATCH_ID, batch_id, "batch")

    def list_batches(self, limit: int, after: str | None) -> dict:
        return _page(self._records("batches", "batch_*.json"), limit, after, "batch")

    def cancel_batch(self, batch_id: str) -> dict:
        """Ask the job to stop; the replica running it notices at its next result."""
        batch = self.get_batch(batch_id)
        if batch["status"] not in FINAL:
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self._save(batch)
            if batch_id in self._tasks:
                self._tasks[batch_id].cancel()
        return batch

    def start(self, interval: float = 10.0):
        """Every ``interval`` seconds, pick up unfinished jobs that no replica is running (their replica
        stopped or was scaled away); every ``SWEEP_INTERVAL_S``, delete what the retention has passed."""
        async def watch():
            swept = 0.0
            while True:
                if (self.root / "batches").is_dir():
                    for batch in self._records("batches", "batch_*.json"):
                        if batch["status"] not in FINAL:
                            self._start(batch["id"])
                if time.monotonic() - swept > SWEEP_INTERVAL_S:
                    swept = time.monotonic()
                    await asyncio.to_thread(self.sweep)
                await asyncio.sleep(interval)

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def sweep(self, now: float | None = None) -> int:
        """Delete the batches that ended more than ``retention_days`` ago, with their files, and uploads that
        old which no remaining batch uses; return how many records went."""
        if self.retention_s is None or not self.root.is_dir():
            return 0
        cutoff, gone, keep = (now or time.time()) - self.retention_s, 0, set()
        for batch in self._records("batches", "batch_*.json"):
            ended = batch.get(f"{batch['status']}_at") if batch["status"] in FINAL else None
            if ended is not None and ended < cutoff:
                for file_id in _files_of(batch) - {batch["input_file_id"]}:
                    self._remove_file(file_id)
                for suffix in (".json", ".lock", ".starts"):
                    (self.root / "batches" / f"{batch['id']}{suffix}").unlink(missing_ok=True)
                gone += 1
            else:
                keep |= _files_of(batch)
        for meta in self._records("files", "file-*.json"):
            if meta["id"] not in keep and meta["created_at"] < cutoff:
                self._remove_file(meta["id"])
                gone += 1
        return gone

    async def close(self):
        tasks = [self._watcher, *self._tasks.values()] if self._watcher else list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, batch_id: str):
        if batch_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._run(batch_id))
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, batch_id: str):
        lock = os.open(self._dir("batches") / f"{batch_id}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another replica runs it
            os.close(lock)
            return
        output = None
        try:
            batch = self.get_batch(batch_id)
            data = await asyncio.to_thread(self.file_path(batch["input_file_id"]).read_bytes)
            requests, invalid = await asyncio.to_thread(parse_batch_input, data, batch["endpoint"])
            output = BatchOutput(self.file_path(batch["output_file_id"]))
            if self._stalled(batch, len(output.done)):
                return
            batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or int(time.time()))
            self._progress(batch, output, len(invalid))
            await run_batch(requests, output, self._send, self._concurrency,
                            lambda: self._progress(batch, output, len(invalid)))
            now = int(time.time())
            batch.update(status="completed", finalizing_at=now, completed_at=now)
            self._progress(batch, output, len(invalid))
        except asyncio.CancelledError:
            if self.get_batch(batch_id)["status"] == "cancelling":
                batch = self.get_batch(batch_id)
                batch.update(status="cancelled", cancelled_at=int(time.time()))
                self._save(batch)
            else:
                raise  # the replica is shutting down: the job stays unfinished and resumes elsewhere
        except Exception:
            logger.exception("batch %s stopped; a replica will resume it", batch_id)
            raise
        finally:
            if output is not None:
                output.close()
            os.close(lock)

    def _stalled(self, batch: dict, done: int) -> bool:
        """Count this start; after ``MAX_STALLED_STARTS`` starts in a row that finished no line (the replicas
        running the job died), fail the job instead of starting it again."""
        path = self.root / "batches" / f"{batch['id']}.starts"
        last = json.loads(path.read_text()) if path.is_file() else {"starts": 0, "done": -1}
        starts = last["starts"] + 1 if last["done"] == done else 1
        _write_json(path, {"starts": starts, "done": done})
        if starts <= MAX_STALLED_STARTS:
            return False
        message = (f"the job started {starts} times in a row without finishing a request: the replicas running it "
                   "stopped (see their logs)")
        logger.error("batch %s failed: %s", batch["id"], message)
        batch.update(status="failed", failed_at=int(time.time()),
                     errors={"object": "list", "data": [{"code": "stalled", "message": message, "param": None,
                                                         "line": None}]})
        self._save(batch)
        return True

    def _progress(self, batch: dict, output: BatchOutput, invalid: int):
        """Persist the counts; stop the job if someone asked to cancel it meanwhile."""
        if self.get_batch(batch["id"])["status"] == "cancelling":
            self._tasks[batch["id"]].cancel()
            return
        batch["request_counts"].update(completed=output.completed, failed=output.failed + invalid)
        self._save(batch)

    def _save(self, batch: dict):
        _write_json(self._dir("batches") / f"{batch['id']}.json", batch)


def _files_of(batch: dict) -> set[str]:
    return {f for f in (batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]) if f}


def _page(records: list[dict], limit: int, after: str | None, kind: str) -> dict:
    """One page of a list route: the records (newest first) after the one with id ``after``."""
    if after is not None:
        ids = [r["id"] for r in records]
        if after not in ids:
            raise APIError(400, f"after: {kind} '{after}' is not in this list", param="after")
        records = records[ids.index(after) + 1:]
    data = records[:limit]
    return {"object": "list", "data": data, "has_more": len(records) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _write_json(path: Path, obj: dict):
    """Replace ``path`` atomically (0600), so a reader never sees half a record."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open_private(tmp, "wb") as f:
        f.write(json.dumps(obj).encode())
    os.replace(tmp, path)
