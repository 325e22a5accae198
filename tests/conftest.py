import os
import sys

import pytest

# tests import their helpers (distributed.py) by module name, and the programs of tools/ (not an
# installed package: its names would collide with other projects') as `tools.<program>`
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Subprocesses (launcher.sh, mpiexec, deepspeed) find this interpreter's environment first, so
# `.venv/bin/python -m pytest` works without activating the venv.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

REQUIRE_GPU_ENV = "REQUIRE_GPU"
# CI sets it (.ci/run): there the multi-node tests must run, a machine where network namespaces
# cannot be made fails them instead of skipping them unnoticed.
REQUIRE_NETNS_ENV = "REQUIRE_NETNS"


# What a launcher tells a rank. A test that runs a program's main in-process exports them
# (LaunchEnv.export_to); leaked into pytest's own environment they reach every later subprocess,
# which then waits for a rank 0 that never comes.
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The caller's own launch variables (a shell that exported MASTER_PORT, a job step that runs the
# suite) are not the tests': every test that launches sets what it needs, so a verdict must not
# depend on them. Dropped before any test or subprocess sees them.
for _key in (*LAUNCH_KEYS, "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(_key, None)


@pytest.fixture(autouse=True)
def launch_environment_untouched(request):
    """Fail (and repair) the test that leaves launch variables in os.environ."""
    before = {key: os.environ.get(key) for key in LAUNCH_KEYS}
    yield
    after = {key: os.environ.get(key) for key in LAUNCH_KEYS}
    if after != before:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        changed = {key: after[key] for key in LAUNCH_KEYS if after[key] != before[key]}
        pytest.fail(f"{request.node.nodeid} left launch variables in os.environ: {changed}", pytrace=False)


def pytest_addoption(parser):
    from suite_budget import add_budget_option

    add_budget_option(parser)


def pytest_configure(config):
    from distributed import hide_gpus
    from suite_budget import SlowTierBudget

    from pretrain.common.quiet import pytest_filters

    config.pluginmanager.register(SlowTierBudget(config), "slow-tier-budget")

    hide_gpus()  # the CPU tiers select the CPU on any machine; the GPU tier asks for the GPUs back
    for line in pytest_filters():  # the programs' own list of library noise, nothing broader
        config.addinivalue_line("filterwarnings", line)
    config.addinivalue_line(
        "markers", "gpu(n=1): needs n CUDA GPUs. Skipped with the reason on a machine without CUDA; fails instead "
                   "of skipping where CUDA is present (too few GPUs) or REQUIRE_GPU=N promises n or more "
                   "(a test needing more than REQUIRE_GPU's N is skipped with the reason).")
    config.addinivalue_line(
        "markers", "netns: needs network namespaces (root and iproute2's `ip`). Skipped with the reason where "
                   "they cannot be created; fails instead with REQUIRE_NETNS=1.")
    config.addinivalue_line(
        "markers", "slow: multi-process or end-to-end; `pytest -m \"not slow\"` is the fast tier.")


def pytest_collection_finish(session):
    """Every test module is imported (torch, DeepSpeed, megatron-core, transformers: about a million
    objects): out of the collector's generations with them, as the zygote does (tests/zygote.py), so
    that a full collection in an in-process test (DeepSpeed forces six per bf16 optimizer it builds)
    scans what the tests made, not 0.2-0.5 s of objects that live as long as the session."""
    import gc

    gc.collect()
    gc.freeze()
    # the zygotes (tests/zygote.py) load torch & co. on the other core while the first tests run,
    # where a selected test can start programs from them: its module took the helpers that do, and
    # it is not a GPU test (those start fresh interpreters; a test's own pytest run selecting one
    # GPU test to see it skip must not pay for two servers)
    helpers = ("start_python", "run_python", "run_ranks", "shell_env", "with_zygote_python", "session_zygote")
    if not session.config.option.collectonly and any(
            any(hasattr(item.module, name) for name in helpers) and item.get_closest_marker("gpu") is None
            for item in session.items if hasattr(item, "module")):
        from distributed import start_session_zygotes

        start_session_zygotes()


@pytest.fixture(scope="session")
def guide_runs(request, tmp_path_factory):
    """The documented guides whose tests this session selected (test_first_run.py,
    test_continued_pretraining.py, test_modernbert_guide.py: each module's run_guide, a chain of
    commands that is mostly one process at a time), run side by side once, when the first of those
    tests starts (tests/side_by_side.py): module name -> what its run_guide returned."""
    from functools import partial

    from side_by_side import side_by_side

    modules = {item.module.__name__: item.module for item in request.session.items
               if "guide" in getattr(item, "fixturenames", ())}
    return side_by_side({name: partial(module.run_guide, tmp_path_factory.mktemp(name))
                         for name, module in modules.items()})


@pytest.fixture
def guide(request, guide_runs):
    """What the test's own module's run_guide returned (its guide, run beside the others)."""
    return guide_runs[request.module.__name__]


def gpu_shortfall(config, needed: int) -> str | None:
    """Why a test needing `needed` GPUs cannot run here, or None when it can (the GPUs the session
    found, counted once, in a child: this process keeps them hidden)."""
    if not hasattr(config, "_gpu_count"):
        from distributed import session_gpu_count

        config._gpu_count = session_gpu_count()
    if config._gpu_count >= needed:
        return None
    return f"needs {needed} CUDA GPU(s), this machine has {config._gpu_count}"


def _required(env: str) -> bool:
    return os.environ.get(env, "0") not in ("", "0")


def promised_gpus() -> int:
    """REQUIRE_GPU=N: the GPUs this machine is promised to have (0: none promised). A GPU test
    needing up to N fails where it cannot run; one needing more is skipped with the reason (a
    one-GPU machine runs the one-GPU tests and skips the rest, by name)."""
    value = os.environ.get(REQUIRE_GPU_ENV, "").strip()
    if value in ("", "0"):
        return 0
    if not value.isdigit():
        raise pytest.UsageError(f"{REQUIRE_GPU_ENV}={value!r}: give the number of GPUs this machine must have "
                                "(e.g. REQUIRE_GPU=1), or 0")
    return int(value)


def _netns_reason(config) -> str | None:
    """Why namespaces cannot be made here, probed once per session."""
    if not hasattr(config, "_netns_reason"):
        from netns import cannot_create_reason

        config._netns_reason = cannot_create_reason()
    return config._netns_reason


def pytest_runtest_setup(item):
    if item.get_closest_marker("netns") is not None:
        reason = _netns_reason(item.config)
        if reason is not None and _required(REQUIRE_NETNS_ENV):
            pytest.fail(f"network-namespace test {item.nodeid}: namespaces cannot be created here ({reason}) "
                        f"and {REQUIRE_NETNS_ENV}=1: it fails rather than skips", pytrace=False)
        if reason is not None:
            pytest.skip(f"network namespaces cannot be created here: {reason}")
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    needed = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    reason = gpu_shortfall(item.config, needed)
    if reason is None:
        return
    present = item.config._gpu_count > 0
    promised = promised_gpus()
    if promised and needed > promised:
        pytest.skip(f"GPU test: {reason}; {REQUIRE_GPU_ENV}={promised} promises {promised}")
    if promised or present:
        pytest.fail(f"GPU test {item.nodeid} {reason} ({REQUIRE_GPU_ENV}={os.environ.get(REQUIRE_GPU_ENV, 'unset')}, "
                    f"CUDA {'present' if present else 'absent'}): GPU tests fail rather than skip "
                    "where a GPU is expected", pytrace=False)
    pytest.skip(f"GPU test: {reason}")


@pytest.fixture
def library_log():
    """The messages the library logs (loggers pretrain.*, finetune.*) during the test, at INFO and
    above: a handler on the library's loggers themselves, so that it sees them whatever a program
    run in this process set (configure_logging stops them reaching the root logger)."""
    import logging

    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect()
    loggers = [logging.getLogger(name) for name in ("pretrain", "finetune")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield lines
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)



@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo world in this process (a FileStore, no launch variables), ended after the
    module: for tests that build a model in-process (its TP group is this world)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
