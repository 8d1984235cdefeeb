"""Ray Serve's side of routing: a RequestRouter that ranks a deployment's replicas by tfq.ray.routing.

The ingress passes each request's key (its prompt's first full page) as the `route` keyword; Ray Serve then takes
the least busy replica of the first rank that accepts the request, so a full replica sends the request on to the
next rank rather than queueing it.
"""
from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tfq.ray.routing import ranked


class PrefixRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("route") if pending_request is not None else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        load = {i: cache.get(r.replica_id) or 0 for i, r in by_id.items()}
        return [[by_id[i] for i in rank] for rank in ranked(list(by_id), key, load)]
