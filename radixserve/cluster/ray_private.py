"""The router's one use of Ray Serve beyond its public request-router API, written for Ray
2.60.0 (the version `scripts/setup.sh cluster` installs).

Everything else in `replica_router.py` is `ray.serve.request_router`'s public surface: `RequestRouter`
(`choose_replicas`, `initialize_state`, `update_replicas`, `on_request_routed`,
`on_replica_actor_died`, `on_replica_actor_unavailable`, `on_new_queue_len_info`,
`curr_replicas`, `replica_queue_len_cache`, `queue_len_response_deadline_s`), the
`LocalityMixin` and `MultiplexMixin` helpers, `PendingRequest.args`, `RunningReplica`
(`replica_id`, `max_ongoing_requests`, `get_queue_len`) and `ReplicaID`.

What the public API lacks: `PendingRequest` is public, but the types of two of its fields are
not (`RequestRoutingContext` and `RequestMetadata`, in `ray.serve._private`), and a router
needs one attribute of each:

- `routing_context.should_backoff`: a router that answers a request without the mixins'
  `apply_*_routing` helpers (which set it themselves) must set it, or Ray Serve calls
  `choose_replicas` again at once, with no backoff, while every replica chosen is full.
- `metadata.multiplexed_model_id`: Ray Serve's default router (`--router pow2`) takes the
  multiplexing helper's candidates for a request naming a model, the locality helper's
  otherwise; the baseline does the same.

Nothing is imported from `ray.serve._private`. tests/cluster/test_ray_private.py pins the Ray
version and checks that these attributes (and the public calls the router makes) are there:
on another Ray version it fails, and this module and `replica_router.py` are to be read against that
version's `ray/serve/_private/request_router/` before the pin moves.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest

RAY_VERSION = "2.60.0"  # the Ray Serve this module was written and checked against


def ask_backoff(pending_request: PendingRequest) -> None:
    """Routing this request again waits (Ray Serve's backoff) when no replica chosen took it."""
    pending_request.routing_context.should_backoff = True


def multiplexed_model_id(pending_request: PendingRequest) -> str:
    """The model the request names for Ray Serve's model multiplexing ('' when none)."""
    model: str = pending_request.metadata.multiplexed_model_id
    return model
