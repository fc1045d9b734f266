"""The coach's reply cache: rendered prompt hash -> the reply that parsed (DESIGN §8).

Keyed by blake2b of the endpoint's model, the sampling settings and the exact messages, so a
prompt seen again (a repeated candidate, a resumed run) costs no call. Only replies that
parsed are stored: a cached garbage reply would turn one bad answer into a permanent
failure. Bounded (least recently used leave first); optionally appended to a JSONL file in
the run directory and reloaded from it, so a resumed run keeps its scores.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)


def prompt_key(*parts: object) -> str:
    """Hash of the parts' JSON form (messages, model name, sampling settings)."""
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(blob.encode("utf-8"), digest_size=16).hexdigest()


class ReplyCache:
    def __init__(self, capacity: int, path: str | Path | None = None) -> None:
        self.capacity = capacity
        self.path = Path(path) if path else None
        self._replies: OrderedDict[str, str] = OrderedDict()
        self.loaded = 0
        if self.path is not None and self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                entry = json.loads(line)
                self._put(entry["key"], entry["reply"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:  # counted: a torn last line
                log.warning("coach cache %s line %d unreadable (%r); skipped", self.path,
                            number, exc)
                continue
            self.loaded += 1

    def get(self, key: str) -> str | None:
        reply = self._replies.get(key)
        if reply is not None:
            self._replies.move_to_end(key)
        return reply

    def _put(self, key: str, reply: str) -> None:
        self._replies[key] = reply
        self._replies.move_to_end(key)
        while len(self._replies) > self.capacity:
            self._replies.popitem(last=False)

    def put(self, key: str, reply: str) -> None:
        self._put(key, reply)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "reply": reply}) + "\n")

    def __len__(self) -> int:
        return len(self._replies)
