"""tfq on Ray (tfq/ray): two engine replicas on a two-node cluster on this machine (ray.cluster_utils.Cluster, one
CPU a node, so Ray places one replica on each), behind the ingress and Ray Serve's proxy: replies under load equal
`tfq serve`'s run alone, and a replica whose bits differ is refused before it takes traffic."""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.cluster_utils import Cluster  # noqa: E402

from serve_load import calls, differences, fire  # noqa: E402
from served import POOL, TINY_PLAN, replies_alone, server, tiny_served  # noqa: E402
from tfq.ray import ReplicaSpec, application, refusal_of  # noqa: E402
from tfq.serve.background import ServeOptions  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nudged(loaded) -> None:
    """The control: the final norm's first weight one float32 step up, so this replica's logits part."""
    w = loaded.model.norm
    w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))


@pytest.fixture(scope="module")
def cluster(tiny_dirs):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the control travels to the replica
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(TINY_PLAN, str(tiny_dirs["qwen2"]), (f"kv.pool={POOL}",), "tiny", ServeOptions(), 1)
    serve.run(application(spec, replicas=2, cpus=1), name="tfq", route_prefix="/")
    yield spec, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def test_the_replicas_are_on_two_nodes_and_checked_before_traffic(cluster):
    _, base = cluster
    health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=60).read())
    assert health["status"] == "ok" and health["self_check"].startswith("the first replica's bits")
    handle = serve.get_deployment_handle("tfq-replica", "tfq")
    nodes = set()
    for _ in range(64):  # the router spreads requests without a key over both: until each has answered once
        nodes.add(handle.facts.remote().result()["where"])
        if len(nodes) == 2:
            break
    assert len(nodes) == 2, nodes


def test_replies_under_load_equal_tfq_serve_alone(cluster, tiny_dirs, tiny_models):
    """16 calls fired at random moments through the ingress (chat and completions, streamed or not, greedy and
    sampled, n = 2, long prompts sharing a first page): each equals its call run alone on a one-process server."""
    _, base = cluster
    load = calls(seed=5, count=16, shared=True)
    together = asyncio.run(fire(base, "tiny", load))
    tiny = tiny_served(tiny_dirs, tiny_models)
    alone = replies_alone(lambda: server(tiny), "tiny", load)
    assert differences(together, alone, load) == []


def test_control_a_replica_whose_bits_differ_is_refused_with_its_chat_step_and_node(cluster):
    spec, _ = cluster
    with pytest.raises(RuntimeError) as refused:
        serve.run(application(ReplicaSpec(**{**spec.__dict__, "harm": nudged}), replicas=1), name="control",
                  route_prefix="/control")
    line = refusal_of("control", refused.value)
    assert "parted from the first replica's bits" in line and "chat " in line and "reply step 0" in line, line
    assert "node " in line
