"""The Ray Serve version the router was written for, and what it relies on there.

`radixserve/cluster/replica_router.py` uses `ray.serve.request_router`'s public API;
`radixserve/cluster/ray_private.py` holds the two attributes that API lacks. Both were written
against Ray 2.60.0. On another version the first test fails: read `ray_private.py` and
`replica_router.py` against that version's `ray/serve/_private/request_router/` (the request router,
`PendingRequest`'s fields, the default power-of-two router, how queue lengths are probed),
then move the pin. The other tests say which of the things relied on went missing.

No Ray instance is started: the routers here are built as Ray Serve builds them, in-process,
with fake replicas (this file may import `ray.serve._private`: it is the version's check).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import random
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.serve.request_router as public
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve._private.common import (DeploymentHandleSource, DeploymentID, ReplicaID,
                                       RequestMetadata)
from ray.serve._private.request_router.common import RequestRoutingContext
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from radixserve.cluster import ray_private
from radixserve.cluster.replica_router import PrefixRouter

CLUSTER = Path(ray_private.__file__).parent


def test_written_for_ray_2_60_0() -> None:
    assert ray_private.RAY_VERSION == "2.60.0"
    assert ray.__version__ == ray_private.RAY_VERSION, (
        f"radixserve's router was written for Ray {ray_private.RAY_VERSION}, this is Ray "
        f"{ray.__version__}: re-check radixserve/cluster/ray_private.py (PendingRequest's "
        "routing_context.should_backoff and metadata.multiplexed_model_id) and replica_router.py "
        "(its pow2 copy of PowerOfTwoChoicesRequestRouter.choose_replicas, its queue-length "
        "probe modelled on RequestRouter._probe_queue_lens) against this version's "
        "ray/serve/_private/request_router/, then move the pin")


def test_the_private_attributes_relied_on_are_there() -> None:
    fields = {f.name: f for f in dataclasses.fields(PendingRequest)}
    hints = typing.get_type_hints(PendingRequest)
    assert hints["routing_context"] is RequestRoutingContext
    assert hints["metadata"] is RequestMetadata
    ctx = fields["routing_context"].default_factory()  # type: ignore[misc]
    assert isinstance(ctx, RequestRoutingContext) and ctx.should_backoff is False
    assert {f.name: f.default for f in dataclasses.fields(RequestMetadata)
            }["multiplexed_model_id"] == ""

    async def check() -> None:
        pr = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("r", "i"))
        assert ray_private.multiplexed_model_id(pr) == ""
        pr.metadata.multiplexed_model_id = "m"
        assert ray_private.multiplexed_model_id(pr) == "m"
        ray_private.ask_backoff(pr)
        assert pr.routing_context.should_backoff is True

    asyncio.run(check())


def test_the_public_calls_made_are_there_in_this_form() -> None:
    assert {"RequestRouter", "RunningReplica", "PendingRequest", "ReplicaID", "LocalityMixin",
            "MultiplexMixin"} <= set(public.__all__)
    for name in ("curr_replicas", "replica_queue_len_cache"):
        assert isinstance(inspect.getattr_static(RequestRouter, name), property), name
    assert isinstance(RequestRouter.queue_len_response_deadline_s, float)
    # 2.60 takes the count; later Ray versions document a ReplicaQueueLengthInfo here
    assert list(inspect.signature(RequestRouter.on_new_queue_len_info).parameters) == [
        "self", "replica_id", "num_ongoing_requests"]
    for name in ("update_replicas", "on_replica_actor_died", "on_replica_actor_unavailable",
                 "on_request_routed", "initialize_state", "apply_locality_routing",
                 "apply_multiplex_routing"):
        assert callable(getattr(PrefixRouter, name)), name
    deadline = inspect.signature(RunningReplica.get_queue_len).parameters["deadline_s"]
    assert deadline.kind is inspect.Parameter.KEYWORD_ONLY


def test_only_the_adapter_goes_past_the_public_api() -> None:
    for path in sorted(CLUSTER.glob("*.py")):  # nothing imported from Ray's private modules
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not [n for n in names if "._private" in n], (path, names)
    # the router reaches no underscored member of Ray Serve's classes: its own only
    source = (CLUSTER / "replica_router.py").read_text()
    used = set(re.findall(r"self\.(_\w+)", source))
    own = {n for n in vars(PrefixRouter) if n.startswith("_")}
    assert used <= own, used - own


class FakeReplica:
    """What the router and Ray Serve's base class read of a replica, and its queue."""

    def __init__(self, name: str, queue: int | None = 0, error: Exception | None = None,
                 delay_s: float = 0.0) -> None:
        self.replica_id = ReplicaID(name, DeploymentID(name="engine", app_name="t"))
        self.node_id, self.availability_zone = f"node-{name}", None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 8
        self.queue, self.error, self.delay_s, self.asked = queue, error, delay_s, 0

    async def get_queue_len(self, *, deadline_s: float) -> int | None:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.queue


def real_router(policy: str) -> PrefixRouter:
    """Built with the arguments Ray Serve's handle gives a router class."""
    r = PrefixRouter(deployment_id=DeploymentID(name="engine", app_name="t"),
                     handle_source=DeploymentHandleSource.UNKNOWN,
                     use_replica_queue_len_cache=True)
    r.initialize_state(policy=policy, deployment="test-" + policy)
    return r


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_pow2_draws_as_ray_serves_default_router(n: int) -> None:
    async def check() -> None:
        r = real_router("pow2")
        reps = [FakeReplica(f"r{i}") for i in range(n)]
        r.update_replicas(reps)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        for seed in range(40):
            picks = []
            for choose in (PrefixRouter.choose_replicas,
                           PowerOfTwoChoicesRequestRouter.choose_replicas):
                random.seed(seed)
                pr = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("r", "i"))
                ranks = await choose(r, list(r.curr_replicas.values()), pr)  # type: ignore
                picks.append(([[x.replica_id.unique_id for x in rank] for rank in ranks],
                              pr.routing_context.should_backoff))
            assert picks[0] == picks[1], (seed, picks)
        assert r.decisions == {"pow2": 40}

    asyncio.run(check())


def test_queue_lengths_from_the_cache_else_asked_of_the_replicas() -> None:
    async def check() -> None:
        r = real_router("prefix")
        r.queue_len_response_deadline_s = 0.5
        cached, fresh = FakeReplica("cached", 5), FakeReplica("fresh", 2)
        dead, away, slow = FakeReplica("dead"), FakeReplica("away"), FakeReplica("slow", 1)
        reps: list[Any] = [cached, fresh, dead, away, slow]
        r.update_replicas(reps)
        await asyncio.sleep(0.2)  # the base class's own probe of new replicas, over
        dead.error, away.error = ActorDiedError(), ActorUnavailableError("gone", None)
        slow.delay_s = 5.0
        for x in reps:
            if x is not cached:
                r.replica_queue_len_cache.invalidate_key(x.replica_id)
        r.on_new_queue_len_info(cached.replica_id, 5)
        r.index.insert("k" * 200, dead.replica_id.to_full_id_str())
        asked = {x.replica_id.unique_id: x.asked for x in reps}
        got = await r._queue_lens(reps)
        assert got == {cached.replica_id.to_full_id_str(): 5,
                       fresh.replica_id.to_full_id_str(): 2}
        assert cached.asked == asked["cached"]  # its cached figure is used
        assert all(x.asked == asked[x.replica_id.unique_id] + 1 for x in reps[1:])
        assert r.replica_queue_len_cache.get(fresh.replica_id) == 2  # answers are cached
        assert dead.replica_id not in r.curr_replicas  # a dead replica is dropped ...
        assert r.index.replicas() == []  # ... with what the index held for it
        assert away.replica_id in r.curr_replicas and slow.replica_id in r.curr_replicas

    asyncio.run(check())
