"""Fixtures shared by the HTTP tests: the tiny model the in-process apps run over (the default
model's loads are in tests/conftest.py), loaded once a session, and server processes shared by
modules that start them with the same arguments.

A loaded `Model` is never changed by an engine or a test (its weights, tokenizer and template
are read only; a test that needs another template makes a copy with `dataclasses.replace`), so
one load serves every in-process app. An engine, a TestClient and a server process keep state
(slots, caches, /metrics counters): tests that read them from zero start their own (see
tests/conftest.py for which stay fresh and why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from radixserve.model.loader import Model, load_model
from tests.http.harness import ServerProcess, running_server


@pytest.fixture(scope="session")
def model(tiny_path: str) -> Model:
    """The tiny model in f32 (the in-process app tests: test_app.py, test_fields.py, ...)."""
    return load_model(tiny_path, dtype="f32")


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Callable[[list[str]], ServerProcess]]:
    """`shared_server(args)`: one `radixserve serve` process per distinct argument list for the
    whole session, started on first use. Only for tests that read outputs which do not depend
    on what ran before on the process (greedy answers, status codes, reuse counts of prompts of
    their own with `>=`): never for a test that reads counters, slots or caches from zero."""
    servers: dict[tuple[str, ...], ServerProcess] = {}
    with ExitStack() as stack:
        def get(args: list[str]) -> ServerProcess:
            key = tuple(args)
            if key not in servers:
                log = tmp_path_factory.mktemp("shared-server") / "server.log"
                servers[key] = stack.enter_context(running_server(list(args), str(log)))
            return servers[key]

        yield get


# The default model as a server runs it by default (bf16 on our kernels, the deterministic mode:
# a cached and a fresh prompt, a batch of one and of two, give the same bits) on 2 slots of
# 2048 tokens: the tool-calling tests (test_tools.py) and the exact constrained-decoding tests
# (test_constrained.py) read only answers and reuse of their own prompts from it. (It ran in
# f32 on dense weights before the mode existed: ~8x slower a token.)
DEFAULT_NP2 = ["-np", "2", "-c", "4096", "--deterministic", "on"]


# The tiny model as the SDK tests run it (test_messages.py, test_responses_api.py: one process
# when they share a worker): one slot, a 2 MiB host tier a few long prompts overflow (the
# cache_control pin test evicts through it) and a 1 MiB pin budget.
TINY_SDK = ["--dtype", "f32", "--weights", "native", "-np", "1", "-c", "2048", "--cache-ram", "2",
            "--cache-pin-mib", "1"]


@pytest.fixture(scope="session")
def default_np2_server(shared_server: Callable[[list[str]], ServerProcess]
                           ) -> ServerProcess:
    return shared_server(DEFAULT_NP2)
