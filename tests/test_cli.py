"""The command-line spine every program runs on (pretrain/cli.py): exit statuses, one-line
messages for the user's mistakes, tracebacks for our bugs, process groups shut down on error."""
import argparse
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from unittest import mock

import pytest

import pretrain.distributed.parallel
from distributed import REPO, run_python
from pretrain.cli import run_command, run_distributed
from pretrain.distributed.device import MAX_CONNECTIONS_ENV
from pretrain.common.errors import UsageError, UserError
from pretrain.distributed.parallel import LaunchEnv

from conftest import LAUNCH_KEYS


def parse(argv):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--fail", choices=("user", "usage", "os", "bug", "interrupt"))
    return parser.parse_args(argv)


def body(args):
    if args.fail == "user":
        raise UserError("data.txt:3: no text")
    if args.fail == "usage":
        raise UsageError("--tp 2 needs an even number of processes")
    if args.fail == "os":
        raise FileNotFoundError(2, "No such file or directory", "data.txt")
    if args.fail == "bug":
        raise ZeroDivisionError("a bug of ours")
    if args.fail == "interrupt":
        raise KeyboardInterrupt
    print("done")


def run(argv, **options):
    return run_command(parse, body, argv, name="tool", **options)


def test_success_is_0(capsys):
    assert run([]) == 0
    assert capsys.readouterr() == ("done\n", "")


def test_user_error_is_one_line_and_1(capsys):
    assert run(["--fail", "user"]) == 1
    assert capsys.readouterr() == ("", "tool: error: data.txt:3: no text\n")


def test_usage_error_is_2(capsys):
    assert run(["--fail", "usage"]) == 2
    assert capsys.readouterr().err == "tool: error: --tp 2 needs an even number of processes\n"
    with pytest.raises(SystemExit) as usage:  # argparse's own: usage line and SystemExit(2), untouched
        run(["--fail", "nonsense"])
    assert usage.value.code == 2
    assert "usage: tool" in capsys.readouterr().err


def test_input_errors_are_reported_only_where_named(capsys):
    assert run(["--fail", "os"], input_errors=(OSError,)) == 1
    assert capsys.readouterr().err == "tool: error: [Errno 2] No such file or directory: 'data.txt'\n"
    with pytest.raises(FileNotFoundError):
        run(["--fail", "os"])


def test_the_training_commands_say_error_without_a_name(capsys):
    assert run_command(parse, body, ["--fail", "user"]) == 1
    assert capsys.readouterr().err == "error: data.txt:3: no text\n"


def test_a_bug_keeps_its_exception(capsys):
    with pytest.raises(ZeroDivisionError):
        run(["--fail", "bug"], input_errors=(OSError, ValueError))
    assert capsys.readouterr().err == ""


def test_interruption(capsys):
    assert run(["--fail", "interrupt"], interrupted="no output written") == 130
    assert capsys.readouterr().err == "tool: interrupted; no output written\n"
    with pytest.raises(KeyboardInterrupt):  # a program that says nothing about it: Python's own
        run(["--fail", "interrupt"])


PROGRAM = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_cli import run
    sys.exit(run(sys.argv[1:]))
""")


@pytest.mark.parametrize("fail,status,lines", [
    ("user", 1, ["tool: error: data.txt:3: no text"]),
    ("usage", 2, ["tool: error: --tp 2 needs an even number of processes"]),
    ("nonsense", 2, None),  # argparse's usage message
    ("bug", 1, None),  # a traceback
])
def test_exit_status_of_a_real_process(fail, status, lines):
    done = run_python(["-c", PROGRAM.format(tests=str(REPO / "tests")), "--fail", fail], timeout=60)
    assert done.returncode == status, done.stderr
    if lines is not None:
        assert done.stderr.splitlines() == lines
    elif fail == "bug":
        assert "Traceback" in done.stderr and "ZeroDivisionError: a bug of ours" in done.stderr
    else:
        assert "usage: tool" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def fake_groups(monkeypatch):
    """init_parallel/shutdown_parallel replaced by recorders; os.environ restored after (monkeypatch.delenv
    of an absent key records nothing to restore, so the exported variables would outlive the test)."""
    calls = []

    def init_parallel(launch, tensor_parallel, pipeline_parallel, timeout_minutes, rendezvous_timeout_minutes=10.0,
                      context_parallel=1):
        calls.append(("init", {key: os.environ.get(key) for key in (*LAUNCH_KEYS, MAX_CONNECTIONS_ENV)},
                      tensor_parallel, pipeline_parallel, timeout_minutes))
        return SimpleNamespace(rank=launch.rank, world_size=launch.world_size, logging_rank=1)

    monkeypatch.setattr(pretrain.distributed.parallel, "init_parallel", init_parallel)
    monkeypatch.setattr(pretrain.distributed.parallel, "shutdown_parallel", lambda: calls.append(("shutdown",)))
    with mock.patch.dict(os.environ):
        for key in (*LAUNCH_KEYS, MAX_CONNECTIONS_ENV):
            os.environ.pop(key, None)
        yield calls


def launch(rank):
    return LaunchEnv(rank, 2, rank, "127.0.0.1", 29511, "torchrun/deepspeed")


def test_run_distributed_exports_the_launch_then_starts_and_stops(fake_groups):
    """Also CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism, before the groups (and the CUDA
    context) exist: megatron-core's all-reduce overlap keeps its order only with one work queue."""
    assert run_distributed(lambda parallel: 3, 2, 1, 5.0, launch(1)) == 3
    exported = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    assert fake_groups == [("init", {**exported, MAX_CONNECTIONS_ENV: "1"}, 2, 1, 5.0), ("shutdown",)]


def test_max_connections_only_with_tensor_parallelism_and_never_over_the_users(fake_groups):
    run_distributed(lambda parallel: 0, 1, 2, launch=launch(1))
    assert fake_groups[0][1][MAX_CONNECTIONS_ENV] is None  # PP and DP only: CUDA's default queues
    os.environ[MAX_CONNECTIONS_ENV] = "32"
    run_distributed(lambda parallel: 0, 2, launch=launch(1))
    assert fake_groups[2][1][MAX_CONNECTIONS_ENV] == "32"


def test_groups_are_shut_down_after_a_user_error(fake_groups, capsys):
    def work(parallel):
        raise UserError("ckpt/meta.json: cannot read")

    # the logging rank (1) raises it for run_command to print; rank 0 returns the status quietly
    with pytest.raises(UserError):
        run_distributed(work, 2, launch=launch(1))
    assert fake_groups[-1] == ("shutdown",)
    fake_groups.clear()
    assert run_distributed(work, 2, launch=launch(0)) == 1
    assert fake_groups[-1] == ("shutdown",) and capsys.readouterr().err == ""

    fake_groups.clear()
    assert run_command(parse, lambda args: run_distributed(work, 2, launch=launch(1)), [], name="tool") == 1
    assert capsys.readouterr().err == "tool: error: ckpt/meta.json: cannot read\n"
    assert [call[0] for call in fake_groups] == ["init", "shutdown"]


def test_groups_are_shut_down_after_a_bug(fake_groups):
    def work(parallel):
        raise ZeroDivisionError("a bug of ours")

    with pytest.raises(ZeroDivisionError):
        run_command(parse, lambda args: run_distributed(work, 2, launch=launch(0)), [], name="tool")
    assert [call[0] for call in fake_groups] == ["init", "shutdown"]


def user_facing_errors():
    """Every error class a program reports as the user's to fix, with its older base."""
    from finetune.features import FeatureError
    from finetune.tasks.base import TaskDataError
    from finetune.finetuner import FinetuneError
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.config import ConfigError
    from pretrain.distributed.device import DeviceError
    from pretrain.data.preprocess.corpus import CorpusError
    from pretrain.data.preprocess.indexed import DataError
    from pretrain.data.preprocess.pipeline import Interrupted, PreprocessError
    from pretrain.data.preprocess.tokenizer import TokenizerError
    from pretrain.data.samples.token_ids import VocabError
    from pretrain.optim.skips import NonFiniteTraining
    from tools.fill_mask import FillMaskError
    from tools.plot_curves import PlotError

    return [(ConfigError, ValueError), (CheckpointError, RuntimeError), (TokenizerError, ValueError),
            (VocabError, ValueError), (DataError, ValueError), (CorpusError, ValueError),
            (PreprocessError, RuntimeError), (Interrupted, RuntimeError), (DeviceError, RuntimeError),
            (TaskDataError, ValueError), (FinetuneError, RuntimeError), (FeatureError, ValueError),
            (FillMaskError, ValueError), (PlotError, ValueError), (NonFiniteTraining, RuntimeError)]


def test_one_base_for_the_users_errors():
    for error, older_base in user_facing_errors():
        assert issubclass(error, UserError) and issubclass(error, older_base), error
    from pretrain.distributed.device import DevicePlacementError

    # a CPU tensor on an NCCL group is our bug: its traceback must stay
    assert not issubclass(DevicePlacementError, UserError)


def load_tool(name):
    """A tools/ script as a module (its main() does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("program,argv,option", [
    ("fill_mask", ["--checkpoint", "c", "--tp", "0"], "--tp"),
    ("extract_features", ["--tp", "-1"], "--tp"),
    ("convert_checkpoint", ["reshard", "--input", "a", "--output", "b", "--tp", "2", "--pp", "0"], "--pp"),
    ("build_vocab", ["--input", "x", "--output-dir", "y", "--vocab-size", "0"], "--vocab-size"),
    ("preprocess_data", ["--input", "x", "--output-prefix", "y", "--vocab-file", "z", "--workers", "0"], "--workers"),
    ("pretrain", ["--check-config", "--world-size", "0", "--config", "c.yaml"], "--world-size"),
])
def test_sizes_below_1_are_bad_usage(program, argv, option, capsys):
    """--tp 0 and the like: argparse's exit status 2 and a line naming the option (the README's
    promise for bad usage), not an error from deep inside."""
    if program == "pretrain":
        from pretrain.main import parse_args
    else:
        parse_args = load_tool(program).parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}: must be a positive integer" in capsys.readouterr().err


def test_hf_to_native_defaults_to_one_process():
    args = load_tool("convert_checkpoint").parse_args(["hf-to-native", "--input", "hf", "--output", "out"])
    assert (args.tp, args.pp) == (1, 1)
    with pytest.raises(SystemExit):  # reshard exists to change the layout: it asks
        load_tool("convert_checkpoint").parse_args(["reshard", "--input", "a", "--output", "b"])


def test_finetune_help_answers_without_torch():
    """`python -m finetune --help` (and a misspelt task) parse with the torch-free task registry,
    whose names are the tasks' own (each kind's module defines its tasks by name)."""
    from finetune.tasks import TASK_NAMES, TASKS

    assert TASK_NAMES == tuple(TASKS)
    assert [TASKS[name].name for name in TASK_NAMES] == list(TASK_NAMES)
    probe = ("import sys\nfrom finetune.main import parse_args\ntry:\n    parse_args(['--help'])\n"
             "except SystemExit:\n    pass\nprint('torch loaded' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().endswith("no torch"), done.stdout[-2000:] + done.stderr[-2000:]
    assert "conll2003" in done.stdout


def test_config_check_reports_every_problem_in_one_round(capsys):
    """A rule the file breaks (the schedule) and a missing data file come in one report, not the
    second only once the first is fixed (docs/training.md: every violated rule, one line each)."""
    from pretrain.main import main

    status = main(["--check-config", "--world-size", "1", "--config", str(REPO / "configs" / "bert-tiny.yaml"),
                   "train.train_steps=10", "data.kind=indexed", "data.paths=[/nonexistent/corpus]",
                   "data.vocab_file=/nonexistent/vocab.txt"])
    err = capsys.readouterr().err
    assert status == 2
    assert "scheduler.warmup_steps (100) must be <= train.train_steps (10)" in err, err
    assert "data.paths: /nonexistent/corpus.bin does not exist" in err, err


def test_an_unknown_key_does_not_hide_the_rules_the_other_keys_break(capsys):
    """Issue 52, item 6: a misspelt key and a rule broken by another key in one report (before, the
    rule came only once the key was fixed)."""
    from pretrain.main import main

    status = main(["--check-config", "--world-size", "1", "--config", str(REPO / "configs" / "bert-tiny.yaml"),
                   "model.hiden_size=64", "train.train_steps=10"])
    err = capsys.readouterr().err
    assert status == 2
    assert "model.hiden_size" in err and "scheduler.warmup_steps (100) must be <= train.train_steps (10)" in err, err
    assert err.count("hiden_size") == 1, err  # each problem once
    # a key refused for its type is not judged by the rules at its default value
    assert main(["--check-config", "--world-size", "1", "--config", str(REPO / "configs" / "bert-tiny.yaml"),
                 "train.train_steps=ten", "optimizer.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "train.train_steps" in err and "optimizer.lr (-1" in err, err
    assert "must be <= train.train_steps" not in err, err


def test_an_old_train_key_is_one_line_naming_its_new_place_and_exit_2(capsys):
    """The keys that moved out of `train` into checkpoint/eval/logging/resilience (no silent alias)."""
    from pretrain.main import main

    status = main(["--check-config", "--world-size", "1", "--config", str(REPO / "configs" / "bert-tiny.yaml"),
                   "train.save_dir=/tmp/ckpt"])
    err = capsys.readouterr().err.splitlines()
    assert status == 2
    assert err == [f"invalid configuration ({REPO / 'configs' / 'bert-tiny.yaml'}):",
                   "command line: train.save_dir has moved: it is checkpoint.save_dir now"], err
