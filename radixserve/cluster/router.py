"""Prefix-aware replica choice, through Ray Serve's public request-router API.

A request goes to the replica that holds the longest prefix of its routing key (`prefix_index`:
what each replica was sent), unless that replica's queue is longer than the least-loaded
replica's by more than `imbalance` requests: then the least-loaded takes it (its prefix is
recomputed once there, and the index learns it). When no replica holds a whole block of the
key, the replica holding the fewest prompts takes it (SGLang's cache-aware router does this),
so documents spread evenly and every replica works.
`policy="pow2"` routes every request with Ray Serve's default router (its `choose_replicas`,
called here): the cluster's baseline for measurements.

The router lives in the ingress's process (Ray Serve runs a handle's router where the handle
is used), so the ingress finds it in `ROUTERS` to list the replicas and their figures.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID,
                                      RequestRouter, RunningReplica)

from radixserve.cluster.bridge import Forwarded
from radixserve.cluster.prefix_index import PrefixIndex

ROUTERS: dict[str, PrefixRouter] = {}  # deployment name -> its router in this process


def _forwarded(pr: PendingRequest | None) -> Forwarded | None:
    if pr is None or not pr.args or not isinstance(pr.args[0], Forwarded):
        return None
    return pr.args[0]


def _rid(r: RunningReplica) -> str:
    return r.replica_id.to_full_id_str()


class PrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix", imbalance: int = 4,
                         block_chars: int = 64, capacity_blocks: int = 65536,
                         **_: Any) -> None:
        if policy not in ("prefix", "pow2"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy, self.imbalance = policy, imbalance
        self.index = PrefixIndex(block_chars, capacity_blocks)
        self.decisions: Counter[str] = Counter()  # why requests went where they went
        self.routed: Counter[str] = Counter()  # replica id -> requests
        self.updated = False
        # Ray Serve ships this class to the ingress pickled by value, with a copy of this
        # module's globals: the registry the ingress reads is the imported module's
        import radixserve.cluster.router as module

        module.ROUTERS[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        """The live replicas ([] until the controller's list has arrived)."""
        if not self.updated:
            return []
        return sorted(_rid(r) for r in self._snapshot())

    def _snapshot(self) -> list[RunningReplica]:
        """The replicas, copied at once: the ingress reads them from its own thread while
        Ray Serve's router loop may change the dict."""
        return list(self._replicas.values())

    def rules(self) -> dict[str, Any]:
        return {"policy": self.policy, "imbalance": self.imbalance,
                "decisions": dict(self.decisions)}

    def figures(self, rid: str) -> dict[str, Any]:
        r = next((r for r in self._snapshot() if _rid(r) == rid), None)
        return {"routed": self.routed.get(rid, 0), "index_blocks": self.index.blocks(rid),
                "max_ongoing_requests": r.max_ongoing_requests if r is not None else None}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        req = _forwarded(pending_request)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy loop when full
        if req is not None and req.target is not None:
            return [[r for r in candidate_replicas if _rid(r) == req.target]]
        if self.policy == "prefix" and req is not None and req.route_key is not None:
            return await self._by_prefix(req.route_key, candidate_replicas)
        self.decisions["pow2"] += 1
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request)  # type: ignore[arg-type]

    async def _by_prefix(self, key: str, candidates: list[RunningReplica],
                         ) -> list[list[RunningReplica]]:
        """Ranks for a request with a routing key. A replica chosen alone (no holder: the one
        holding least, the less loaded of those; a holder too busy: the least loaded) is
        recorded as holding the key at once, so the same document's requests arriving together
        follow it rather than scatter before the first of them is sent."""
        held = self.index.match(key, [_rid(r) for r in candidates])
        best = max(held.values(), default=0)
        queue = await self._queue_lens(candidates)  # a replica that gave none counts as 0

        def load(r: RunningReplica) -> int:
            return queue.get(_rid(r), 0)

        def alone(r: RunningReplica, why: str) -> list[list[RunningReplica]]:
            self.decisions[why] += 1
            self.index.insert(key, _rid(r))
            return [[r], [x for x in candidates if x is not r]]

        if best == 0:  # a new prompt: to the replica holding least, as SGLang's router does
            least = min(self.index.blocks(_rid(r)) for r in candidates)
            smallest = [r for r in candidates if self.index.blocks(_rid(r)) == least]
            lightest = min(load(r) for r in smallest)
            return alone(random.choice([r for r in smallest if load(r) == lightest]), "new")
        holders = [r for r in candidates if held[_rid(r)] == best]
        if min(load(r) for r in holders) - min(load(r) for r in candidates) > self.imbalance:
            return alone(min(candidates, key=load), "least_loaded")
        self.decisions["prefix"] += 1
        # then by how much each holds; equals in one rank, where Ray Serve takes the least loaded
        lengths = sorted({held[_rid(r)] for r in candidates}, reverse=True)
        return [[r for r in candidates if held[_rid(r)] == n] for n in lengths]

    async def _queue_lens(self, candidates: list[RunningReplica]) -> dict[str, int]:
        """Queue lengths from Ray Serve's cache, asking the replicas it has no fresh figure for."""
        out: dict[str, int] = {}
        unknown = []
        for r in candidates:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                unknown.append(r)
            else:
                out[_rid(r)] = n
        if unknown:
            for r, n in await self._probe_queue_lens(unknown, 0):
                if n is not None:
                    out[_rid(r)] = n
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        req = _forwarded(pending_request)
        if req is None or req.target is not None:
            return  # a per-replica call (figures, /replicas/{i}/...) says nothing of load
        rid = replica_id.to_full_id_str()
        self.routed[rid] += 1
        if req.route_key is not None:
            self.index.insert(req.route_key, rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.updated = True  # the controller's list has arrived
        alive = {_rid(r) for r in replicas}
        for rid in self.index.replicas():
            if rid not in alive:
                self.index.remove(rid)
