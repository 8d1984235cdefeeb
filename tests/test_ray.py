"""tfq on Ray (tfq/ray): two engine replicas on a two-node cluster on this machine (ray.cluster_utils.Cluster, one
CPU a node, so Ray places one replica on each), behind the ingress and Ray Serve's proxy: replies under load equal
`tfq serve`'s run alone; a replica killed mid-reply, its streams go on elsewhere with the same bits; a replica
whose bits differ is refused before it takes traffic; and tp 2 with its second rank on the other node equals one
process."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.cluster_utils import Cluster  # noqa: E402

from serve_load import Call, calls, corpus_text, differences, fire, send  # noqa: E402
from served import TINY_PLAN, replies_alone, server, tiny_served  # noqa: E402
from tfq.ray import ReplicaSpec, application, refusal_of  # noqa: E402
from tfq.ray.ingress import prompt_ids  # noqa: E402
from tfq.ray.routing import ranked, route_key  # noqa: E402
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
    c.add_node(num_cpus=1, resources={"tfq_rank": 1})  # the node a tensor-parallel rank may take
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # eight lanes and pages enough for them: every stream of a test runs at once (the bits do not depend on it: the
    # one-process server they are compared with keeps the tests' small pool)
    spec = ReplicaSpec(TINY_PLAN, str(tiny_dirs["qwen2"]), ("lanes=8", "kv.pool=64"), "tiny", ServeOptions(), 1)
    serve.run(application(spec, replicas=2, cpus=1), name="tfq", route_prefix="/")
    yield spec, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def health(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/health", timeout=60).read())


def replicas() -> dict[str, dict]:
    """Each replica's facts, by its id: the router spreads calls without a key over the idle replicas, so asking a
    few times hears from both."""
    handle = serve.get_deployment_handle("tfq-replica", "tfq")
    seen: dict[str, dict] = {}
    for _ in range(64):
        facts = handle.facts.remote().result()
        seen[facts["replica"]] = facts
        if len(seen) == 2:
            break
    return seen


def test_the_replicas_are_on_two_nodes_and_checked_before_traffic(cluster):
    _, base = cluster
    assert health(base)["status"] == "ok" and health(base)["self_check"].startswith("the first replica's bits")
    assert len({f["where"] for f in replicas().values()}) == 2


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
    try:
        with pytest.raises(RuntimeError) as refused:
            serve.run(application(ReplicaSpec(**{**spec.__dict__, "harm": nudged}), replicas=1), name="control",
                      route_prefix="/control")
        line = refusal_of("control", refused.value)
    finally:
        serve.delete("control")  # no more tries of its self-check beside the other tests
    assert "parted from the first replica's bits" in line and "chat " in line and "reply step 0" in line, line
    assert "node " in line


def test_a_replica_killed_mid_reply_its_streams_go_on_elsewhere_with_the_same_bits(cluster, tiny_dirs, tiny_models):
    """Eight streamed chats (greedy and sampled, log-probabilities) share their first page, so they start on its
    replica; when each has had a few chunks that replica is killed (SIGKILL). Every stream completes, each equal to
    its chat alone on a one-process server in ids, log-probabilities and digests, and the ingress counts the moves."""
    _, base = cluster
    tok = tiny_models["qwen2"].tokenizer
    text = corpus_text(random.Random(0), 300, 0)
    load = [Call(f"s{i}", True, True, 0.0, {"messages": [{"role": "user", "content": f"{text} {i}"}],
                                             "max_tokens": 150, "temperature": 0.8 if i % 2 else 0.0, "seed": i,
                                             "logprobs": True, "top_logprobs": 2,
                                             "extra_body": {"return_token_ids": True, "return_digests": True}})
            for i in range(8)]
    facts = replicas()
    page = next(iter(facts.values()))["page_rows"]
    ids = prompt_ids(tok, "v1/chat/completions", {"model": "tiny", "messages": load[0].body["messages"]})
    assert len(ids) >= page
    home = facts[ranked(list(facts), route_key(ids, page))[0][0]]
    moved_before = health(base)["moved"]
    arrived, killed = [0], asyncio.Event()

    async def after_chunk(k: int) -> None:  # every stream waits at its third chunk until the kill
        if k == 3:
            arrived[0] += 1
            if arrived[0] == len(load):
                os.kill(home["pid"], signal.SIGKILL)
                killed.set()
            await killed.wait()

    async def streams():
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(send(client, "tiny", call, after_chunk) for call in load))

    together = asyncio.run(streams())
    tiny = tiny_served(tiny_dirs, tiny_models)
    assert differences(together, replies_alone(lambda: server(tiny), "tiny", load), load) == []
    assert health(base)["moved"] > moved_before
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=60).read().decode()
    assert f"tfq_ray_streams_moved_total {float(health(base)['moved'])}" in metrics and "tfq_prompt_tokens" in metrics


def test_tp_2_with_its_second_rank_on_the_other_node_equals_one_process(cluster, tiny_models):
    """Ranks placed by Ray (tfq/ray/ranks.py): this process is rank 0 on the head node, rank 1 an actor on the node
    that alone offers `tfq_rank`. Every forward's logits equal one process's bit for bit; the all-reduce split's
    differ (RED by construction)."""
    import engines
    from tfq.engine.stream import Request
    from tfq.model.load import load_model
    from tfq.parallel.ranks import place_ranks, ranks
    from tfq.ray.ranks import place_on_ray

    folder = str(tiny_models["qwen3"].folder)
    requests = [Request(prompt=tuple(range(5 + 3 * i, 40 + 7 * i)), max_tokens=5) for i in range(4)]
    place_on_ray({"tfq_rank": 1})
    try:
        runs = {name: engines.run(loaded.model, requests, window=256, lanes=3, keep_logits=True)
                for name, loaded in (("one", tiny_models["qwen3"]), ("tp2", load_model(folder, progress=False, tp=2)),
                                     ("reduce", load_model(folder, progress=False, tp=2, reduce=True)))}
        group = ranks(2, torch.device("cpu"))
        assert ray.get(group.processes[0].node) != ray.get_runtime_context().get_node_id()
        group.stop()
    finally:
        place_ranks(None)
    for one, tp2, reduce in zip(runs["one"], runs["tp2"], runs["reduce"]):
        assert one.ids == tp2.ids and all(torch.equal(a, b) for a, b in zip(one.logits, tp2.logits))
        assert not torch.equal(one.logits[0], reduce.logits[0])
