"""`radixserve cluster`: start (or join) Ray, run the application, serve until interrupted."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from typing import Any

log = logging.getLogger("radixserve.cluster")
ENGINE = "engine"  # the engine replicas' deployment

EPILOG = """Every other flag is `radixserve serve`'s (llama-server's, see `radixserve serve
--help`): each replica runs with them; --host, --port and --ssl-key-file/--ssl-cert-file are
Ray Serve's HTTP ingress's. Without -t, a local cluster gives each replica an equal share of
the cores.

Several machines: `ray start --head --port 6379` on one, `ray start --address HEAD:6379` on
the others (each with radixserve installed), then `radixserve cluster --address HEAD:6379 ...`
on any of them; Ray places the replicas by --replica-cpus."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(  # no -h: serve's short flags (-hf, -hft...) pass through
        prog="radixserve cluster", allow_abbrev=False, epilog=EPILOG, add_help=False,
        description="radixserve replicas on Ray Serve, behind one HTTP ingress, each request "
                    "routed to the replica that holds the longest prefix of its prompt.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--help", action="help", help="show this help and exit")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas (default: 2)")
    ap.add_argument("--address", default=None,
                    help="join this Ray cluster (HOST:PORT, or 'auto') and leave it running "
                         "on exit; default: start a local Ray instance, stopped on exit")
    ap.add_argument("--name", default="radixserve",
                    help="the Ray Serve application's name (default: radixserve)")
    ap.add_argument("--router", choices=("prefix", "pow2"), default="prefix",
                    help="prefix: prefix-aware (default); pow2: Ray Serve's default "
                         "power-of-two choices, for comparison")
    ap.add_argument("--imbalance", type=int, default=4,
                    help="a prefix holder whose queue is longer than the shortest by more "
                         "than this many requests is passed over (default: 4)")
    ap.add_argument("--replica-cpus", type=float, default=1.0,
                    help="Ray CPUs each replica reserves (default: 1)")
    ap.add_argument("--max-ongoing-requests", type=int, default=64,
                    help="requests a replica takes at once; more wait in the router "
                         "(default: 64)")
    return ap


def _fail(msg: str) -> int:
    print(f"radixserve cluster: error: {msg}", file=sys.stderr)
    return 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str]) -> int:
    a, serve_argv = build_parser().parse_known_args(argv)
    for name, value, least in (("--replicas", a.replicas, 1), ("--imbalance", a.imbalance, 0),
                               ("--replica-cpus", a.replica_cpus, 0),
                               ("--max-ongoing-requests", a.max_ongoing_requests, 1)):
        if value < least:
            return _fail(f"{name} must be at least {least}, got {value:g}")
    try:
        import ray
        from ray import serve
        from ray.serve.config import RequestRouterConfig
    except ImportError:
        return _fail("Ray Serve is not installed: pip install 'radixserve[cluster]'")
    from radixserve.log_setup import setup_logging
    from radixserve.cluster.deployments import EngineReplica, Ingress, serve_config
    from radixserve.flags import FlagError, FlagExit

    try:
        cfg = serve_config(serve_argv)
    except FlagExit as e:
        print(e.text, end="")
        return 0
    except (FlagError, ValueError) as e:
        return _fail(str(e))
    if cfg.host.endswith(".sock") or "," in cfg.host:
        return _fail("--host: the Ray Serve ingress listens on one address, not a socket")
    if cfg.port == 0:
        return _fail("--port 0 (a free port) is for `radixserve serve`; the Ray Serve ingress "
                     "needs a port given")
    if cfg.threads < 1:  # Ray would give each replica OMP_NUM_THREADS = its CPUs, silently
        share = _cores() // a.replicas if a.address is None else math.floor(a.replica_cpus)
        serve_argv = [*serve_argv, "-t", str(max(1, share))]
    setup_logging(cfg)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the replicas read the flags' environment variables (LLAMA_ARG_*, LLAMA_API_KEY) where
    # they run, which on another node is not this shell: they travel with the deployments
    env = {k: v for k, v in os.environ.items() if k.startswith("LLAMA_")}
    actor: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
    if a.address is None:
        cpus = max(_cores(), math.ceil(a.replicas * a.replica_cpus))
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=a.address, logging_level=logging.WARNING)
    stop, serving = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:  # set after ray.init, which installs its own for SIGTERM
        stop.set()
        if not serving.is_set():  # still deploying: interrupt it
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if a.name in serve.status().applications:
        ray.shutdown()
        return _fail(f"a Ray Serve application named {a.name!r} is already running on this "
                     "Ray cluster (--name)")
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port,
                                  "ssl_keyfile": cfg.ssl_key_file,
                                  "ssl_certfile": cfg.ssl_cert_file})
        router = RequestRouterConfig(  # by import path: Ray ships the class to the ingress
            request_router_class="radixserve.cluster.replica_router.PrefixRouter",  # type: ignore[arg-type]
            request_router_kwargs={"policy": a.router, "imbalance": a.imbalance,
                                   "deployment": ENGINE})  # the ingress finds it by this name
        engine: Any = serve.deployment(
            EngineReplica, name=ENGINE, num_replicas=a.replicas,
            ray_actor_options={"num_cpus": a.replica_cpus, **actor},
            max_ongoing_requests=a.max_ongoing_requests, request_router_config=router,
            graceful_shutdown_timeout_s=5)
        ingress: Any = serve.deployment(Ingress, name="ingress", num_replicas=1,
                                        ray_actor_options={"num_cpus": 0, **actor},
                                        max_ongoing_requests=10_000)
        serve.run(ingress.bind(engine.bind(serve_argv), serve_argv, ENGINE), name=a.name,
                  route_prefix="/")
        serving.set()
        if not stop.is_set():
            scheme = "https" if cfg.ssl_cert_file else "http"
            log.info("HTTP server listening on %s://%s:%d (%d replicas, %s router)", scheme,
                     cfg.host, cfg.port, a.replicas, a.router)
            print(f"radixserve cluster: listening on {scheme}://{cfg.host}:{cfg.port}",
                  flush=True)
        stop.wait()
    except KeyboardInterrupt:
        return _fail("interrupted before the application was up")
    finally:
        serving.set()  # a second signal while stopping only asks again
        try:
            if a.address is None:
                serve.shutdown()
            else:  # a shared cluster: remove our application only
                serve.delete(a.name)
        except Exception as e:  # never hide why we are stopping
            log.warning("stopping Ray Serve: %s", e)
        ray.shutdown()
    return 0
