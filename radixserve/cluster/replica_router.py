"""Prefix-aware replica choice, through Ray Serve's public request-router API.

A request goes to the replica that holds the longest prefix of its routing key (`prefix_index`:
what each replica was sent), unless that replica's queue is longer than the least-loaded
replica's by more than `imbalance` requests: then the least-loaded takes it (its prefix is
recomputed once there, and the index learns it). When no replica holds a whole block of the
key, the replica holding the fewest prompts takes it (SGLang's cache-aware router does this),
so documents spread evenly and every replica works.
`policy="pow2"` routes every request as Ray Serve's default router does (its power-of-two
choices, step for step, through the public mixins' helpers): the cluster's baseline for
measurements.

Only `ray.serve.request_router`'s public names are used here; the two attributes it lacks
(a request's backoff flag and its multiplexed model id) are read and set in `ray_private`,
which names the Ray version it was written for.

The router lives in the ingress's process (Ray Serve runs a handle's router where the handle
is used), so the ingress finds it in `ROUTERS` to list the replicas and their figures.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID,
                                      RequestRouter, RunningReplica)

from radixserve.cluster import ray_private
from radixserve.cluster.bridge import Forwarded
from radixserve.cluster.prefix_index import PrefixIndex

log = logging.getLogger("ray.serve")  # where Ray Serve's own router logs a failed probe

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
                         deployment: str = "engine", **_: Any) -> None:
        """`deployment`: the name the ingress finds this router under in `ROUTERS` (the
        deployment it routes for: Ray Serve gives a router no public name for it)."""
        if policy not in ("prefix", "pow2"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy, self.imbalance = policy, imbalance
        self.index = PrefixIndex(block_chars, capacity_blocks)
        self.decisions: Counter[str] = Counter()  # why requests went where they went
        self.routed: Counter[str] = Counter()  # replica id -> requests
        self.updated = False
        # Ray Serve ships this class to the ingress pickled by value, with a copy of this
        # module's globals: the registry the ingress reads is the imported module's
        import radixserve.cluster.replica_router as module

        module.ROUTERS[deployment] = self

    def replica_ids(self) -> list[str]:
        """The live replicas ([] until the controller's list has arrived)."""
        if not self.updated:
            return []
        return sorted(_rid(r) for r in self._snapshot())

    def _snapshot(self) -> list[RunningReplica]:
        """The replicas, copied at once: the ingress reads them from its own thread while
        Ray Serve's router loop may change the dict."""
        return list(self.curr_replicas.values())

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
            ray_private.ask_backoff(pending_request)  # no busy loop when full
        if req is not None and req.target is not None:
            return [[r for r in candidate_replicas if _rid(r) == req.target]]
        if self.policy == "prefix" and req is not None and req.route_key is not None:
            return await self._by_prefix(req.route_key, candidate_replicas)
        self.decisions["pow2"] += 1
        return self._pow2(pending_request)

    def _pow2(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Ray Serve 2.60's default router (`PowerOfTwoChoicesRequestRouter.choose_replicas`,
        not public), step for step: the multiplexing helper's candidates for a request naming
        a model, else the locality helper's; two of them drawn at random, in random order, as
        one rank (Ray Serve then takes the less loaded of the two that accepts)."""
        if pending_request is not None and ray_private.multiplexed_model_id(pending_request):
            ids = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            ids = self.apply_locality_routing(pending_request=pending_request)
        if not ids:
            return []
        candidates = tuple(ids)
        n = len(candidates)
        if n == 1:
            chosen = [candidates[0]]
        elif n == 2:
            chosen = list(candidates) if random.getrandbits(1) else [candidates[1], candidates[0]]
        else:
            i = random.randrange(n)
            j = random.randrange(n - 1)
            chosen = [candidates[i], candidates[j + 1 if j >= i else j]]
        replicas = self.curr_replicas
        return [[replicas[c] for c in chosen]]

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
        cache = self.replica_queue_len_cache
        for r in candidates:
            n = cache.get(r.replica_id)
            if n is None:
                unknown.append(r)
            else:
                out[_rid(r)] = n
        if unknown:
            for r, n in await self._probe(unknown):
                if n is not None:
                    out[_rid(r)] = n
        return out

    async def _probe(self, replicas: list[RunningReplica],
                     ) -> list[tuple[RunningReplica, int | None]]:
        """Each replica's queue length, asked of it within Ray Serve's deadline, as Ray Serve's
        own routers ask (its private `_probe_queue_lens`, first attempt), through the public
        calls: an answer goes into the cache (`on_new_queue_len_info`); none in time, or an
        error, gives None; a dead replica is dropped (`on_replica_actor_died`), an unreachable
        one's cached figure forgotten (`on_replica_actor_unavailable`)."""
        deadline = self.queue_len_response_deadline_s
        asks = {asyncio.ensure_future(r.get_queue_len(deadline_s=deadline)): r for r in replicas}
        done, late = await asyncio.wait(asks, timeout=deadline)
        out: list[tuple[RunningReplica, int | None]] = []
        for t in late:
            t.cancel()
            out.append((asks[t], None))
            log.warning("Failed to get queue length from %s within %ss.",
                        asks[t].replica_id, deadline)
        for t in done:
            r, e = asks[t], t.exception()
            if e is None:
                n = t.result()
                self.on_new_queue_len_info(r.replica_id, n)
                out.append((r, n))
                continue
            out.append((r, None))
            if isinstance(e, ActorDiedError):
                self.on_replica_actor_died(r.replica_id)
            elif isinstance(e, ActorUnavailableError):
                self.on_replica_actor_unavailable(r.replica_id)
            log.warning("Failed to fetch queue length for %s: %r", r.replica_id, e)
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
