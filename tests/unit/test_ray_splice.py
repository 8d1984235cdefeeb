"""A streamed reply joined across replicas (tfq/ray/splice.py): the client's events read as one replica's."""
from __future__ import annotations

import json

from tfq.ray.splice import DONE, Splice


def event(doc: dict) -> bytes:
    return f"data: {json.dumps(doc)}\n\n".encode()


def chunk(id_: str, created: int, delta: dict, ids: list[int], finish=None) -> dict:
    return {"id": id_, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}]}


def test_a_stream_that_never_moved_is_the_replicas_bytes_less_the_ids_it_did_not_ask_for():
    first = [event(chunk("a", 1, {"role": "assistant", "content": ""}, [])), event(chunk("a", 1, {"content": "Hi"},
                                                                                           [7, 8]))]
    asked = Splice(wants_ids=True)
    assert b"".join(asked.feed(b"".join(first) + DONE)) == b"".join(first) + DONE and asked.ids == [7, 8]
    plain = Splice(wants_ids=False)
    out = plain.feed(first[1][:20]) + plain.feed(first[1][20:])  # an event cut across chunks comes out whole
    assert out == [event({**chunk("a", 1, {"content": "Hi"}, []), "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]})]
    assert plain.ids == [7, 8]


def test_a_resumed_stream_keeps_the_first_id_and_drops_its_second_opening():
    s = Splice(wants_ids=True)
    s.feed(event(chunk("a", 1, {"role": "assistant", "content": ""}, [])) + event(chunk("a", 1, {"content": "Hi"},
                                                                                        [7])))
    s.resume()
    out = s.feed(event(chunk("b", 2, {"role": "assistant", "content": ""}, [])) +
                 event(chunk("b", 2, {"content": " there"}, [9], "stop")) + DONE)
    assert out == [event(chunk("a", 1, {"content": " there"}, [9], "stop")), DONE]
    assert s.ids == [7, 9] and s.ended
    control = Splice(wants_ids=True)  # RED: not told it resumed, the second replica's id passes through
    control.feed(event(chunk("a", 1, {"role": "assistant", "content": ""}, [])))
    assert control.feed(event(chunk("b", 2, {"content": " there"}, [9]))) == [
        event(chunk("b", 2, {"content": " there"}, [9]))]


def test_a_reply_resumed_before_its_opening_reached_the_client_keeps_the_new_one():
    s = Splice(wants_ids=False)
    s.resume()  # its replica died before the first event
    opening = chunk("b", 2, {"role": "assistant", "content": ""}, [])
    assert s.feed(event(opening)) == [event({**opening, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})]


def test_a_reply_whose_last_chunk_was_sent_is_finished():
    s = Splice(wants_ids=True)
    s.feed(event(chunk("a", 1, {"content": "Hi"}, [7], "length")))
    assert s.finished and not s.ended  # the ingress then ends the stream rather than resume it
