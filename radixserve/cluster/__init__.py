"""`radixserve cluster`: radixserve replicas as one Ray Serve application, routed by prompt prefix.

One ingress deployment (FastAPI behind Ray Serve's HTTP proxy) forwards every request, as
bytes, to an engine replica that runs the very app `radixserve serve` runs (so every route
behaves the same); `router.PrefixRouter` picks the replica that holds the longest prefix of
the rendered prompt. Ray is imported only here: `serve` does not need it.
"""
