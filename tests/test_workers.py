"""The suite's spread over xdist workers (tests/workers.py): Ray tests together, files whole,
heaviest first, and the weights naming files that exist."""

from __future__ import annotations

from pathlib import Path

from tests import workers


def test_every_cluster_test_is_in_one_group_and_every_other_file_is_its_own():
    assert workers.group_of("tests/cluster/test_cluster_pow2.py") == workers.RAY_GROUP
    assert workers.group_of("tests/cluster/test_routing.py") == workers.RAY_GROUP
    assert workers.group_of("tests/http/test_api.py") == "tests/http/test_api.py"
    assert workers.group_of("tests/clusterish/test_x.py") == "tests/clusterish/test_x.py"


def test_heaviest_unit_runs_first_and_each_keeps_its_order():
    paths = ["tests/text/test_light.py", "tests/text/test_light.py",
             "tests/model/test_deterministic.py", "tests/model/test_deterministic.py",
             "tests/cluster/test_routing.py", "tests/cluster/test_cluster_pow2.py",
             "tests/engine/test_deterministic.py", "tests/text/test_other_light.py"]
    order = workers.run_order(paths)
    assert sorted(order) == list(range(len(paths)))  # nothing dropped or repeated
    ran = [paths[i] for i in order]
    assert ran[0] == "tests/engine/test_deterministic.py"
    # the Ray group's weight is its files' summed (still below model/test_deterministic's)
    assert workers._weight("tests/model/test_deterministic.py") > workers._weight(workers.RAY_GROUP)
    assert ran[1:3] == ["tests/model/test_deterministic.py"] * 2
    # the Ray group weighs its files together, and keeps them side by side, in their order
    assert ran[3:5] == ["tests/cluster/test_routing.py", "tests/cluster/test_cluster_pow2.py"]
    # light files last, in collection order
    assert ran[-3:] == ["tests/text/test_light.py", "tests/text/test_light.py",
                        "tests/text/test_other_light.py"]
    assert order[-3:] == [0, 1, 7]


def test_groups_reach_xdist_as_the_scheduler_reads_them(request):
    # xdist's hook writes the marks into the test ids; ours must add them before it runs
    impl = workers.pytest_collection_modifyitems.pytest_impl  # type: ignore[attr-defined]
    assert impl.get("tryfirst") and not impl.get("trylast")
    # on a loadgroup worker (./scripts/test.sh's whole suite) the id carries the group: not so
    # with pytest 9.2, whose ids xdist 3.8 cannot rewrite (every test was scheduled alone)
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@tests/test_workers.py"), request.node.nodeid


def test_weights_name_files_of_the_suite():
    root = Path(__file__).resolve().parent.parent
    missing = [p for p in workers.HEAVY if not (root / p).is_file()]
    assert not missing, f"tests/workers.py HEAVY names files that are gone: {missing}"
