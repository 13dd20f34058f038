"""The two test tiers: the whole suite (`./scripts/test.sh`, what CI runs) and the fast tier
(`./scripts/test.sh fast`, i.e. `-m "not slow"`), the edit loop.

A test is `slow` when it needs a server process, Ray, a browser or a default-model generation
loop, or when it alone takes long enough to break the fast tier's budget (under 4 minutes on the
2-core machine). Why a rule and not a hand-kept list alone: the classification is checked while
the tests run. A test left in the fast tier that starts a server, Ray, Chromium, or a scheduler
over the default model fails naming what it did, so the fast tier cannot quietly grow slow.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

# Whole files: every test in them starts a server process, a Ray cluster or a browser, or runs
# the default model's generation loop (an engine or scheduler over it). Reason after each.
SLOW_FILES: dict[str, str] = {
    "tests/bench/test_bench_e2e.py": "server processes",
    "tests/bench/test_modes.py": "server processes",
    "tests/bench/test_soak.py": "a server process",
    "tests/cluster/test_cluster_pow2.py": "Ray",
    "tests/cluster/test_cluster_prefix.py": "Ray",
    "tests/engine/test_agent_sessions.py": "default-model generation",
    "tests/engine/test_cache_view.py": "default-model generation",
    "tests/engine/test_context_shift.py": "default-model generation",
    "tests/engine/test_deterministic.py": "default-model generation",
    "tests/engine/test_disk_tier.py": "default-model generation",
    "tests/engine/test_kv_types.py": "default-model generation",
    "tests/engine/test_slot_actions.py": "default-model generation",
    "tests/engine/test_speculative.py": "default-model generation",
    "tests/engine/test_reuse.py": "default-model generation",
    "tests/engine/test_swa.py": "Gemma 3 generation",
    "tests/http/test_api.py": "server processes",
    "tests/http/test_port_zero_wire.py": "a server process",
    "tests/http/test_cache_salt_http.py": "default-model generation",
    "tests/http/test_constrained.py": "server processes",
    "tests/http/test_embeddings.py": "default-model embeddings (its forward) and HF's",
    "tests/http/test_disconnects.py": "server processes",
    "tests/http/test_disk_http.py": "server processes",
    "tests/http/test_host_cache.py": "server processes",
    "tests/http/test_multi_task.py": "default-model generation",
    "tests/http/test_radix_http.py": "server processes",
    "tests/http/test_sampling_llama.py": "default-model generation",
    "tests/http/test_server_defaults.py": "default-model generation",
    "tests/http/test_slot_http.py": "server processes",
    "tests/http/test_spec_http.py": "server processes",
    "tests/http/test_swa_http.py": "server processes",
    "tests/http/test_tools_cache.py": "server processes",
    "tests/router/test_router_e2e.py": "a router and its child server processes",
    "tests/model/test_neon.py": "aarch64 cross-builds of every kernel, run under qemu (a minute)",
    "tests/model/test_deterministic.py": "default-model forwards on every kernel variant (minutes)",
    "tests/model/test_gemma3.py": "Gemma 3 against transformers (minutes)",
    "tests/webui/test_page.py": "a browser and a server process",
}
# Single tests in files that are otherwise fast (node-id prefixes).
SLOW_TESTS: dict[str, str] = {
    "tests/model/test_device.py::test_engine_on_the_device_build_names_every_device[":
        "default-model generation",
    "tests/http/test_server_flags.py::test_seed_command_line_starts_a_server": "a server process",
    "tests/http/test_server_flags.py::test_deterministic_mode_is_reported_by_props":
        "server processes",
    "tests/http/test_server_flags.py::test_bad_kernel_variant_stops_startup":
        "server processes (that stop at start-up)",
    "tests/http/test_server_flags.py::test_an_unreachable_device_stops_startup":
        "server and perf processes (that stop at start-up)",
    "tests/test_cli.py::test_generate_": "`radixserve generate` processes",
    "tests/engine/test_cache_salt.py::test_own_slot": "default-model generation",
    "tests/engine/test_cache_salt.py::test_device_sharing_between_slots":
        "default-model generation",
    "tests/engine/test_cache_salt.py::test_host_cache": "default-model generation",
    "tests/http/test_webui.py::test_cache_view_on_the_default_model": "default-model generation",
    "tests/http/test_webui.py::test_the_cache_view_shows_no_prompt_text_by_default":
        "default-model generation",
    "tests/http/test_server_flags.py::test_deterministic_on_where_it_cannot_hold_stops_startup":
        "a server process (loads the model, then stops)",
    "tests/http/test_errors.py::test_model_that_fails_to_load_stops_the_server":
        "a server process",
    "tests/model/test_forward.py::test_default_model_matches_hf_logits_and_greedy":
        "default-model greedy generation beside transformers' (~40 s)",
    "tests/model/test_forward.py::test_native_bf16_greedy_matches_hf": "default-model generation",
    "tests/model/test_forward.py::test_kernel_path_as_close_to_reference_as_torch_ops":
        "default-model generation",
    "tests/model/test_head_blocks.py::test_loaded_models_hold_their_tied_tables_in_blocks":
        "loads Gemma 3 and the default model (~17 s)",
    "tests/model/test_forward.py::test_tiny_architectures_match_hf":
        "transformers' reference of each architecture (~10 s each)",
    "tests/model/test_i8_tiles.py::test_loader_runs_them_packed_only_with_avx512bf16":
        "loads Gemma 3 (~11 s)",
    # a module's shared server process (started by a session fixture: the guard's hook
    # `pytest_runtest_setup` catches those too)
    **{f"tests/http/test_errors.py::{name}": "a server process" for name in (
        "test_api_key", "test_bad_requests", "test_bodies_json_decodes_badly_are_400",
        "test_huge_max_tokens_stops_at_the_context",
        "test_prompt_longer_than_context_names_both_numbers",
        "test_server_still_serves_after_errors",
        "test_surrogate_pairs_and_moderate_nesting_are_fine", "test_unknown_route_is_404")},
    **{f"tests/http/test_tools.py::{name}": "the default model's server process" for name in (
        "test_agent_loop", "test_bad_requests_leave_the_server_serving",
        "test_hermes_template_call", "test_reasoning_split",
        "test_streamed_call_equals_the_non_streamed_one",
        "test_tool_choice_none_named_and_parallel")},
    # the official SDKs against a real server (the module's shared one)
    **{f"tests/http/test_messages.py::{name}": "a server process" for name in (
        "test_a_message_streamed_and_not", "test_a_forced_tool_call_its_result_and_the_answer",
        "test_stop_sequences", "test_count_tokens_is_the_completion_s_prompt",
        "test_cache_fields_are_the_server_s_timings",
        "test_a_cache_control_pin_survives_an_eviction_that_takes_an_unpinned_prefix",
        "test_bad_requests_in_anthropic_s_shape")},
    **{f"tests/http/test_responses_api.py::{name}": "a server process" for name in (
        "test_create_streamed_and_not", "test_input_tokens_counts_the_prompt",
        "test_forced_function_call_then_its_output", "test_json_schema_text_format",
        "test_previous_response_chain_computes_only_new_tokens",
        "test_retrieve_delete_and_namespaces", "test_bad_input_is_a_400_in_openai_shape")},
}

# `radixserve` sub-commands that run a model however they are called (`serve` and `cluster`
# with good flags run through ServerProcess, guarded itself: with bad ones they exit at once)
_RUNNING_COMMANDS = {"generate", "perf", "bench"}


def file_of(item: pytest.Item) -> str:
    """The test's file, as SLOW_FILES and tests/workers.py name files."""
    return os.path.relpath(str(item.path), str(item.config.rootpath)).replace(os.sep, "/")


def slow_reason(item: pytest.Item) -> str | None:
    path = file_of(item)
    if path in SLOW_FILES:
        return SLOW_FILES[path]
    return next((why for prefix, why in SLOW_TESTS.items() if item.nodeid.startswith(prefix)),
                None)


def pytest_configure(config: pytest.Config) -> None:
    _guard_shared_servers()
    config.addinivalue_line(
        "markers", "slow: needs a server process, Ray, a browser or a default-model generation "
        "loop, or takes minutes (tests/tiers.py); left out of `./scripts/test.sh fast`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        why = slow_reason(item)
        if why is not None:
            item.add_marker(pytest.mark.slow(reason=why))


def _refuse(what: str) -> None:
    pytest.fail(f"{what} in a fast-tier test: add it to SLOW_FILES or SLOW_TESTS in "
                "tests/tiers.py (the fast tier runs none)", pytrace=False)


def _running_argv(args: Any) -> str | None:
    """What a child process would be, when it is one the fast tier refuses."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    names = [os.path.basename(a) for a in argv]
    if "radixserve.cli" in argv:
        rest = argv[argv.index("radixserve.cli") + 1:]
        sub = next((a for a in rest if not a.startswith("-")), None)
        if sub in _RUNNING_COMMANDS and "--help" not in rest and "-h" not in rest:
            return f"a `radixserve {sub}` process"
    if names and names[0] in ("ray", "raylet", "gcs_server", "chromium", "chromium-browser"):
        return f"a {names[0]} process"
    if any("playwright" in a for a in argv):
        return "a browser (Playwright's driver)"
    return None


_SETTING_UP_FAST: list[bool] = [False]  # a fast-tier test is being set up or run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any of the test's fixtures: a server a session- or module-scoped fixture starts
    for it is started on its account (the guard below patches too late for those)."""
    _SETTING_UP_FAST[0] = item.get_closest_marker("slow") is None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _SETTING_UP_FAST[0] = False  # a shared server stopping at the session's end is no test's


def _guard_shared_servers() -> None:
    from radixserve.server_proc import ServerProcess

    enter = ServerProcess.__enter__
    if getattr(enter, "tier_guarded", False):
        return

    def guarded(self: ServerProcess) -> ServerProcess:
        if _SETTING_UP_FAST[0]:
            _refuse(f"a `radixserve {self.command[0]}` server process (a shared fixture's)")
        return enter(self)

    guarded.tier_guarded = True  # type: ignore[attr-defined]
    ServerProcess.__enter__ = guarded  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def fast_tier_guard(request: pytest.FixtureRequest,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails a fast-tier test that starts what only the slow tier may."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    from radixserve.server_proc import ServerProcess
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.default_model import default_model_path

    execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded_execute(self: subprocess.Popen[Any], args: Any, *rest: Any) -> Any:
        what = _running_argv(args)
        if what is not None:
            _refuse(what)
        return execute(self, args, *rest)

    init = Scheduler.__init__
    default = os.path.realpath(default_model_path())

    def guarded_init(self: Scheduler, model: Any, *args: Any, **kw: Any) -> None:
        if os.path.realpath(model.path) == default:
            _refuse("a scheduler over the default model (its generation loop)")
        init(self, model, *args, **kw)

    def guarded_enter(self: ServerProcess) -> ServerProcess:
        _refuse(f"a `radixserve {self.command[0]}` server process")
        return self

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded_execute)
    monkeypatch.setattr(ServerProcess, "__enter__", guarded_enter)
    monkeypatch.setattr(Scheduler, "__init__", guarded_init)
    yield
