"""Messages between rank 0 and the other ranks, signed with the run's secret: a header (the payload's length and
the message's number, with their MAC) read before any length is trusted, then the payload after its own MAC, unpickled
only once the MAC proves this run's rank 0 sent it as that number (tfq/parallel/ranks.py sends and receives them)."""
from __future__ import annotations

import hmac
import pickle
import struct

from tfq.errors import TfqError

MAC_BYTES = 32  # HMAC-SHA256
FIELDS = struct.Struct("<qq")  # a message's header: its payload's length, then its number (1, 2, ...)
HEAD_BYTES = FIELDS.size + MAC_BYTES  # the fields and their MAC: what a rank reads before it trusts a length
MAX_MESSAGE = 1 << 30  # the most a rank allocates for one message (a step's inputs: kilobytes to megabytes)


def _mac(secret: bytes, kind: bytes, data: bytes) -> bytes:
    """kind (b"head" or b"body") keeps a header's MAC from passing for a payload's, or the reverse."""
    return hmac.new(secret, kind + data, "sha256").digest()


def _forged() -> TfqError:
    return TfqError("a message failed its HMAC check (not sent by this run's rank 0): refused unread; this rank "
                    "stops, start the run again")


def header(secret: bytes, number: int, length: int) -> bytes:
    """What comes before message `number`: its payload's length and its number, then their MAC."""
    fields = FIELDS.pack(length, number)
    return fields + _mac(secret, b"head", fields)


def read_header(secret: bytes, number: int, data: bytes) -> int:
    """The length of message `number`'s payload, from its header: trusted (and allocated) only once the MAC
    proves rank 0 of this run wrote it, the number is the one due and the length within MAX_MESSAGE."""
    fields, mac = data[:FIELDS.size], data[FIELDS.size:]
    if len(data) != HEAD_BYTES or not hmac.compare_digest(mac, _mac(secret, b"head", fields)):
        raise _forged()
    length, got = FIELDS.unpack(fields)
    if got != number:
        raise TfqError(f"message {got} of this run arrived when message {number} was due (replayed or out of "
                       "order): refused unread; this rank stops, start the run again")
    if not 0 <= length <= MAX_MESSAGE:
        raise TfqError(f"message {got} announced {length} bytes, not within the 0 to {MAX_MESSAGE} a rank takes: "
                       "refused unread; this rank stops, start the run again")
    return length


def sealed(secret: bytes, number: int, payload: bytes) -> bytes:
    """Message `number`'s payload after its MAC (over the number too: no other message's payload passes)."""
    return _mac(secret, b"body", FIELDS.pack(len(payload), number) + payload) + payload


def opened(secret: bytes, number: int, data: bytes):
    """Message `number`, unpickled only once its MAC proves rank 0 of this run sent it as that number."""
    mac, payload = data[:MAC_BYTES], data[MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, b"body", FIELDS.pack(len(payload), number) + payload)):
        raise _forged()
    return pickle.loads(payload)
