"""A user's task gone wrong, in every way we could think of: one line naming the task, the part and the fix,
exit 2, no traceback, and no checkpoint touched. In this process, world size 1 (tests/integration has the
same on two ranks)."""

from __future__ import annotations

import pytest

from tests.support.checkpoint_damage import checkpoint_bytes
from trainer.api import run
from trainer.errors import EXIT_USAGE

TINY = ["--epochs", "1", "--batch-size", "8", "--progress", "off", "--no-tensorboard", "--num-workers", "0"]
BROKEN = "tests.support.broken_tasks"


def fails(capsys: pytest.CaptureFixture[str], tmp_path, task: str, *extra: str) -> str:
    """The one error line of a run that must exit 2."""
    code = run(argv=["--task", task, *TINY, "--output-dir", str(tmp_path), *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == EXIT_USAGE and len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.parametrize(("task", "message"), [
    ("nosuchpackage.tasks:Forecast", "--task nosuchpackage.tasks:Forecast: no module named 'nosuchpackage' in the "
                                     "current directory ("),
    ("tests.support.broken_import:Task", "importing tests.support.broken_import failed: ModuleNotFoundError: No "
                                         "module named 'sensor_toolkit_not_installed' (at "),
    (f"{BROKEN}:Forecast", f"module {BROKEN} ("),
    (f"{BROKEN}:Pairs", "Pairs lacks name, datasets, model, loss; a task defines name, datasets(context), model(data) "
                        "and loss(outputs, targets)"),
    (f"{BROKEN}:LacksLoss", "LacksLoss lacks loss"),
    (f"{BROKEN}:NoName", "NoName.name must be a non-empty string"),
    (f"{BROKEN}:OptionsNotADataclass", "OptionsNotADataclass.Options must be a dataclass of option() fields"),
    (f"{BROKEN}:OptionWithoutDefault", "option width of OptionWithoutDefault.Options has no default"),
    (f"{BROKEN}:TinyOptions", "TinyOptions lacks name, datasets, model, loss"),
    ("forecasting", "--task 'forecasting': not a built-in task (classification) and not an import path"),
])
def test_a_task_that_cannot_be_found_or_lacks_a_part_is_named_with_the_fix(task, message, capsys, tmp_path):
    assert message in fails(capsys, tmp_path, task)


def test_a_missing_attribute_lists_what_the_module_defines(capsys, tmp_path):
    line = fails(capsys, tmp_path, f"{BROKEN}:Forecast")
    assert "has no 'Forecast'; it defines " in line and "TinyTask" in line


@pytest.mark.parametrize(("task", "message"), [
    ("DatasetsRaise", "task 'tiny' (tests.support.broken_tasks:DatasetsRaise): datasets() raised FileNotFoundError: "
                      "/data/sensors.csv (at "),
    ("DatasetsReturnAList", "datasets() returned a list; return a trainer.task.TaskData(train=..., eval=...)"),
    ("IterableData", "the train dataset (Stream) is not map-style: it needs __len__ and __getitem__"),
    ("ModelRaises", "model() raised ValueError: hidden size must be even, got 7 (at "),
    ("ModelIsNotAModule", "model() returned a function, not a torch.nn.Module"),
    ("ItemOfTheWrongShape", "the training dataset: item 5 has (a float32 tensor of shape [3], a float32 tensor of "
                            "shape [1]) but 7 other item(s) of its batch have (a float32 tensor of shape [4], "),
    ("ItemOfTheWrongType", "the training dataset: item 2 is a str; each item must be an (inputs, targets) pair"),
    ("EvalItemOfTheWrongShape", "the evaluation dataset: item 3 has (a float32 tensor of shape [4, 2]"),
    ("ModelDoesNotFitTheData", "the model's forward pass on the first training batch raised RuntimeError: mat1 "
                               "and mat2 shapes cannot be multiplied (8x4 and 6x1)"),
    ("LossIsNotOneNumber", "loss() must return one number (a 0-dim tensor, the batch's mean), got a tensor of "
                           "shape [8, 1]"),
    ("PlainObjectMetric", "metric 'rmse' is a Collector, which cannot be reduced across ranks; use a "
                          "trainer.metrics.Metric"),
    ("MetricWithoutState", "metric 'count' (Counting) declares no state with add_state()"),
    ("MonitorsAMissingMetric", "monitor 'f1' is not one of its metrics (loss); --keep-best keeps the best checkpoint"),
    ("MetricOfManyNumbers", "task 'tiny' (tests.support.broken_tasks:MetricOfManyNumbers): metric 'per_feature' "
                            "computed a tensor of shape [4]; a metric's value must be one number"),
])
def test_a_broken_part_of_a_task_is_one_line_naming_it(task, message, capsys, tmp_path):
    assert message in fails(capsys, tmp_path, f"{BROKEN}:{task}")
    assert not list((tmp_path / "checkpoints").glob("step-*")), "no checkpoint written"


@pytest.mark.parametrize("task", ["DatasetsRaise", "ItemOfTheWrongShape", "LossIsNotOneNumber", "MetricOfManyNumbers"])
def test_a_broken_task_leaves_an_earlier_runs_checkpoints_untouched(task, capsys, tmp_path):
    assert run(argv=["--task", f"{BROKEN}:TinyTask", *TINY, "--output-dir", str(tmp_path)]) == 0
    before = checkpoint_bytes(tmp_path / "checkpoints")
    capsys.readouterr()
    fails(capsys, tmp_path, f"{BROKEN}:{task}", "--epochs", "2")  # resumes there, then fails
    assert checkpoint_bytes(tmp_path / "checkpoints") == before


def test_resuming_another_tasks_checkpoint_is_refused_naming_both(capsys, tmp_path):
    assert run(argv=["--task", f"{BROKEN}:TinyTask", *TINY, "--output-dir", str(tmp_path)]) == 0
    before = checkpoint_bytes(tmp_path / "checkpoints")
    capsys.readouterr()
    line = fails(capsys, tmp_path, "classification", "--dataset", "synthetic", "--synthetic-train-size", "64",
                 "--synthetic-test-size", "32")
    assert (f"is of task 'tiny' ({BROKEN}:TinyTask) but this run trains 'classification'; pass --task "
            f"{BROKEN}:TinyTask, or use another --checkpoint-dir, or --resume none") in line
    assert checkpoint_bytes(tmp_path / "checkpoints") == before


def test_a_changed_option_of_a_task_is_refused_or_needs_the_flag(capsys, tmp_path):
    args = ["--task", "classification", "--dataset", "synthetic", "--synthetic-train-size", "64",
            "--synthetic-test-size", "32", *TINY, "--output-dir", str(tmp_path)]
    assert run(argv=args) == 0
    capsys.readouterr()
    assert "was trained with --dataset synthetic and this run asks for mnist" in fails(
        capsys, tmp_path, "classification", *args[2:], "--dataset", "mnist", "--data-dir", str(tmp_path))
    assert "--lr 0.001 -> 0.01, which changes the training from here on; to resume so, pass " \
           "--allow-resume-change lr" in fails(capsys, tmp_path, "classification", *args[2:], "--lr", "0.01")
    assert run(argv=[*args, "--lr", "0.01", "--allow-resume-change", "lr", "--epochs", "2"]) == 0
    assert "resuming with a change: --lr 0.001 -> 0.01" in capsys.readouterr().err


def test_under_a_global_batch_the_unused_batch_size_may_change_and_the_global_one_is_flagged(capsys, tmp_path):
    args = ["--task", "classification", "--dataset", "synthetic", "--synthetic-train-size", "64",
            "--synthetic-test-size", "32", *TINY, "--output-dir", str(tmp_path), "--global-batch-size", "16"]
    assert run(argv=args) == 0
    assert "--global-batch-size 16: 16 sample(s) per rank per micro-batch at 1 rank(s) (--batch-size is not used)" \
        in capsys.readouterr().err
    assert run(argv=[*args, "--batch-size", "4", "--epochs", "2"]) == 0  # --batch-size was never used: no flag
    assert "resuming with a change: --epochs 1 -> 2" in capsys.readouterr().err
    assert "--global-batch-size 16 -> 32, which changes the training from here on; to resume so, pass " \
           "--allow-resume-change global_batch_size" in fails(capsys, tmp_path, "classification", *args[2:],
                                                              "--global-batch-size", "32", "--epochs", "3")


def test_a_bad_item_found_in_a_dataloader_worker_is_the_same_one_line(capsys, tmp_path):
    """The DataLoader re-raises a worker's error with the worker's traceback as its message; the user sees
    the original line only."""
    line = fails(capsys, tmp_path, f"{BROKEN}:ItemOfTheWrongShape", "--num-workers", "1")
    assert line.startswith("[rank 0] error: task 'tiny' (tests.support.broken_tasks:ItemOfTheWrongShape): the "
                           "training dataset: item 5 has (a float32 tensor of shape [3]"), line
