"""How the suite spreads over pytest-xdist workers (`./scripts/test.sh` runs `-n auto --dist
loadgroup`; on the 2-core machine the whole suite took ~27 minutes on one process, and 15 on two
workers after issue 37's trims).

- A file is one unit of work and runs on one worker, so a module's servers and reference runs
  are still computed once (a session fixture once a worker).
- Every test under tests/cluster/ runs on one worker, one after another: a local Ray instance
  takes fixed ports, and `ray stop --force` (after a replica had to be killed) stops every Ray
  instance on the machine, another worker's too.
- The heaviest files start first (HEAVY, measured: the seconds each file took in a whole run),
  so that no long file starts when the other workers are almost done.
  A file not listed is light; the list only orders the work, it cannot drop or skip a test.
"""

from __future__ import annotations

import pytest

from tests.tiers import file_of

# seconds a file's tests took (setup included) in the whole suite on 2 workers (2-core AMD EPYC,
# a clean clone's `.ci/run` with --junitxml, summed by file)
HEAVY: dict[str, float] = {
    "tests/engine/test_deterministic.py": 270,
    "tests/model/test_deterministic.py": 134,
    "tests/http/test_constrained.py": 96,
    "tests/model/test_gemma3.py": 94,
    "tests/model/test_forward.py": 75,
    "tests/model/test_neon.py": 59,
    "tests/http/test_swa_http.py": 57,
    "tests/cluster/test_cluster_prefix.py": 56,
    "tests/cluster/test_cluster_pow2.py": 55,
    "tests/model/test_kernels.py": 52,
    "tests/engine/test_kv_types.py": 50,
    "tests/http/test_embeddings.py": 49,
    "tests/http/test_server_flags.py": 46,
    "tests/http/test_api.py": 43,
    "tests/router/test_router_e2e.py": 43,
    "tests/engine/test_speculative.py": 39,
    "tests/engine/test_lfm2_engine.py": 34,  # a quiet 2-core run of the file alone
    "tests/model/test_lfm2.py": 30,  # estimated likewise
    "tests/model/test_qwen35.py": 20,  # a quiet 2-core run of the file alone
    "tests/test_qwen35_files.py": 19,  # likewise
    "tests/engine/test_recurrent_engine.py": 44,  # likewise (with the machine busy)
    "tests/model/test_granite_hybrid.py": 37,  # likewise
    "tests/engine/test_swa.py": 30,  # estimated: its tests run on a tiny LFM2 too
    "tests/http/test_radix_http.py": 34,
    "tests/http/test_tools_cache.py": 27,
    "tests/engine/test_disk_tier.py": 26,
    "tests/http/test_multi_task.py": 25,
    "tests/http/test_tools.py": 23,
    "tests/bench/test_bench_e2e.py": 22,
    "tests/http/test_disk_http.py": 21,
    "tests/http/test_host_cache.py": 20,
    "tests/bench/test_soak.py": 19,
    "tests/webui/test_page.py": 18,
    "tests/model/test_head_blocks.py": 18,
    "tests/model/test_malformed_gguf.py": 18,
    "tests/http/test_spec_http.py": 17,
    "tests/http/test_cache_salt_http.py": 13,
    "tests/http/test_slot_http.py": 12,
    "tests/http/test_infill.py": 11,
    "tests/test_cli.py": 10,
    "tests/http/test_sampling_llama.py": 9,
    "tests/http/test_errors.py": 9,
    "tests/bench/test_synth_model.py": 31,  # estimated: an LFM2 shape through HF, and the
    # qwen2 / qwen3 / gemma3 tiny shapes (about 4 s each) added
    "tests/engine/test_cache_salt.py": 9,
    "tests/http/test_fuzz_schema.py": 9,
    "tests/engine/test_agent_sessions.py": 9,
    "tests/http/test_server_defaults.py": 8,
    "tests/http/test_disconnects.py": 8,
    "tests/model/test_step.py": 8,
}

RAY_GROUP = "tests/cluster"


def group_of(path: str) -> str:
    """The unit of work a test file belongs to."""
    return RAY_GROUP if path.startswith(RAY_GROUP + "/") else path


def _weight(group: str) -> float:
    if group == RAY_GROUP:
        return sum(s for p, s in HEAVY.items() if group_of(p) == RAY_GROUP)
    return HEAVY.get(group, 0.0)


def run_order(paths: list[str]) -> list[int]:
    """The positions of the collected tests (each given by its file) in the order they run:
    the heaviest unit of work first; a stable sort keeps each unit's own order, so a module's
    tests stay together and its fixtures live as long as before."""
    first: dict[str, int] = {}
    for p in paths:
        first.setdefault(group_of(p), len(first))
    return sorted(range(len(paths)),
                  key=lambda i: (-_weight(group_of(paths[i])), first[group_of(paths[i])]))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before xdist's own hook, which turns each `xdist_group` mark into the `@group` suffix of
    the test's id that `--dist loadgroup` schedules by: a mark added after it is never seen,
    and every test is then scheduled alone (a module's fixtures built on both workers, two Ray
    clusters at once: CI's killed-replica failure)."""
    paths = [file_of(it) for it in items]
    for item, path in zip(items, paths):
        item.add_marker(pytest.mark.xdist_group(group_of(path)))
    items[:] = [items[i] for i in run_order(paths)]
