"""The single-server baseline of the cluster tests, computed once per session."""

from __future__ import annotations

import pytest

from radixserve.server_proc import ServerProcess
from tests.cluster.workload import LOGS, SERVER_ARGS, Answer, run_workload


@pytest.fixture(scope="session")
def single_server_answers() -> list[Answer]:
    LOGS.mkdir(parents=True, exist_ok=True)
    with ServerProcess(SERVER_ARGS, LOGS / "single.log", ready_timeout_s=120) as srv:
        return run_workload(srv.url)
