"""A streamed reply that outlives its replica: the server-sent events the client got, and the events of the reply
resumed on another replica, joined into the one stream the client would have got from the first.

The ingress asks every streamed request for its token ids (`return_token_ids`), so it knows the reply's tokens sent so
far; when the replica dies it sends the request again with `resume_token_ids` (tfq/serve/protocol.py), and the new
replica goes on after them with the same bits (tfq/engine/core.py: a resumed stream). Its events are made to read
as the first replica's: the same id and creation time, no second opening chunk (a chat's role), and no token ids
where the client did not ask for them. Events are re-serialized as the app writes them (json.dumps' defaults), so a
stream that never moved is byte for byte the replica's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

DONE = b"data: [DONE]\n\n"


@dataclass
class Splice:
    wants_ids: bool  # the client asked for token ids itself
    ids: list[int] = field(default_factory=list)  # the reply's tokens sent to the client so far
    first: dict | None = None  # the first event's id and created, which resumed events take
    resumed: bool = False  # the events now come from a replica that resumed the reply
    opened: bool = False  # the opening chunk (a chat's role) was sent
    finished: bool = False  # the choice's last chunk (its finish_reason) was sent: nothing is left to resume
    ended: bool = False  # [DONE] was sent
    _buffer: bytes = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events to send the client for this chunk of a replica's stream (whole events only)."""
        self._buffer += chunk
        out = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            sent = self._event(event + b"\n\n")
            if sent is not None:
                out.append(sent)
        return out

    def resume(self) -> None:
        """The next events come from a replica that resumed the reply after `ids`."""
        self.resumed, self._buffer = True, b""

    def _event(self, event: bytes) -> bytes | None:
        if event == DONE:
            self.ended = True
            return event
        if not event.startswith(b"data: "):
            return event
        doc = json.loads(event[len(b"data: "):])
        if "choices" not in doc:  # an error event
            return event
        if self.first is None:
            self.first = {"id": doc.get("id"), "created": doc.get("created")}
        elif self.resumed:
            doc.update(self.first)
        opening = not self.ids_in(doc) and self._opening(doc)
        if opening and self.opened:  # the resumed reply's opening chunk: the client had it from the first replica
            return None
        self.opened = self.opened or opening
        changed = self.resumed  # its id and creation time are the first replica's
        for choice in doc["choices"]:
            self.ids += choice.get("token_ids") or []
            self.finished = self.finished or choice.get("finish_reason") is not None
            if not self.wants_ids and "token_ids" in choice:
                del choice["token_ids"]
                changed = True
        return f"data: {json.dumps(doc)}\n\n".encode() if changed else event  # as the replica wrote it, if we can

    @staticmethod
    def ids_in(doc: dict) -> bool:
        return any(c.get("token_ids") for c in doc["choices"])

    @staticmethod
    def _opening(doc: dict) -> bool:
        """A chat stream's first chunk: the role, no text, no reason to finish."""
        return all(c.get("delta", {}).get("role") and not c["delta"].get("content") and not c.get("finish_reason")
                   for c in doc["choices"]) if doc["choices"] else False
