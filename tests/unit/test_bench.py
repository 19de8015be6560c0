"""The benchmark suite's bookkeeping, on fake figures: no timing is taken or asserted here.

`make bench-quick` (run by CI) exercises the measurements themselves; these tests pin down what a run
writes: results.json that reads back, results.md with one table row per measurement and the plots it
references, a failed figure recorded without losing the others, and --only keeping earlier figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import run as bench_run
from bench.harness.context import Context
from bench.harness.results import FigureResult, Goal, Row, read_json
from devtools.s3_server import ServerDied
from tests.support.preconditions import unavailable


def fake_figures() -> list[FigureResult]:
    parts = {"forward": 0.03, "backward": 0.05, "sync": 0.0, "optimizer": 0.002, "wall": 0.09,
             "main_thread_cpu": 0.08, "waiting_for_core": 0.004, "blocked": 0.006}
    return [
        FigureResult(1, "scaling", "Scaling efficiency on CPU",
                     [Row("the trainer: 2 ranks / (2 × 1 process)", 0.85, Goal(">=", 0.9), "note", (0.8, 0.88)),
                      Row("2 processes that never communicate (ceiling)", 0.93)],
                     {"step_parts_s": {"single": parts, "ddp": {**parts, "wall": 0.1}}}),
        FigureResult(5, "accuracy", "Time to accuracy",
                     [Row("time to 90%: 2 ranks / 1 process", 0.55, Goal("<=", 0.6))],
                     {"target": 0.9, "curves": {"1 process": [[10.0, 0.85], [20.0, 0.91]],
                                                "2 ranks": [[6.0, 0.84], [11.0, 0.905]]}}),
        FigureResult(8, "launch", "Launch latency",
                     [Row("TorchX local_cwd / bare torchrun hello", None, notes="not measured (torchx missing)")]),
    ]


def header(quick: bool = True) -> dict[str, object]:
    return {"quick": quick, "started": "2026-01-01T00:00:00+00:00", "duration_s": 12.0, "load_average": "1.0",
            "command": "python -m bench.run --quick", "machine": {"summary": "a test machine"}}


def test_goals_hold_ratios_to_a_bound_in_either_direction():
    assert Goal(">=", 0.9).met(0.9) and not Goal(">=", 0.9).met(0.89)
    assert Goal("<=", 0.6).met(0.55) and not Goal("<=", 0.6).met(0.61)
    assert Row("not measured", None, Goal(">=", 0.9)).met is None


def test_saved_results_read_back_with_goals_verdicts_and_spreads(tmp_path):
    bench_run.save(tmp_path, header(), fake_figures())
    _, figures = read_json(tmp_path / "results.json")
    first = figures[0].rows[0]
    assert (first.ratio, first.goal, first.spread, first.met) == (0.85, Goal(">=", 0.9), (0.8, 0.88), False)
    raw = json.loads((tmp_path / "results.json").read_text())
    assert raw["figures"][1]["rows"][0]["met"] is True


def test_markdown_has_a_row_per_measurement_and_shows_the_plots_it_wrote(tmp_path):
    bench_run.save(tmp_path, header(), fake_figures())
    markdown = (tmp_path / "results.md").read_text()
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # the header and one line per row
    assert "| 0.850 (0.80–0.88) | ≥ 0.90 | **no** |" in markdown
    assert "not measured (torchx missing)" in markdown
    pictures = [line.split("(")[1].rstrip(")") for line in markdown.splitlines() if line.startswith("![")]
    assert {"summary.png", "scaling.png", "scheduling.png", "step_parts.png", "time_to_accuracy.png"} <= set(pictures)
    assert all((tmp_path / picture).stat().st_size > 0 for picture in pictures)


def test_a_failing_figure_is_recorded_and_the_others_are_still_written(tmp_path, monkeypatch):
    def broken(ctx: Context) -> FigureResult:
        raise RuntimeError("no rendezvous")

    def fake(ctx: Context) -> FigureResult:
        assert ctx.quick
        return fake_figures()[1]

    monkeypatch.setitem(bench_run.FIGURES, "scaling", ("Scaling efficiency on CPU", broken))
    monkeypatch.setitem(bench_run.FIGURES, "accuracy", ("Time to accuracy", fake))
    code = bench_run.main(["--quick", "--only", "scaling", "--only", "accuracy", "--output-dir", str(tmp_path)])
    assert code == 1
    _, figures = read_json(tmp_path / "results.json")
    by_key = {figure.key: figure for figure in figures}
    assert by_key["scaling"].error == "RuntimeError: no rendezvous"
    assert by_key["accuracy"].rows[0].ratio == 0.55


def test_a_figure_whose_server_died_is_measured_once_more_and_says_so(tmp_path, monkeypatch):
    calls = []

    def server_dies_once(ctx: Context) -> FigureResult:
        calls.append(1)
        if len(calls) == 1:
            raise ServerDied("moto_server on http://127.0.0.1:1 exited with -9 while in use")
        return fake_figures()[1]

    def server_always_dies(ctx: Context) -> FigureResult:
        raise ServerDied("moto_server exited with -9 while in use")

    monkeypatch.setitem(bench_run.FIGURES, "accuracy", ("Time to accuracy", server_dies_once))
    monkeypatch.setitem(bench_run.FIGURES, "scaling", ("Scaling efficiency on CPU", server_always_dies))
    code = bench_run.main(["--quick", "--only", "accuracy", "--only", "scaling", "--output-dir", str(tmp_path)])
    assert code == 1 and len(calls) == 2  # a second death fails the figure: retried once, never more
    by_key = {figure.key: figure for figure in read_json(tmp_path / "results.json")[1]}
    assert by_key["accuracy"].rows[0].ratio == 0.55
    assert "exited with -9" in by_key["accuracy"].details["retried_after"]
    assert by_key["scaling"].error.startswith("ServerDied: moto_server exited")


@pytest.mark.parametrize("quick", [True, False])
def test_only_replaces_its_figures_and_keeps_the_others_of_the_same_mode(tmp_path, monkeypatch, quick):
    bench_run.save(tmp_path, header(quick=True), fake_figures())
    monkeypatch.setitem(bench_run.FIGURES, "accuracy", ("Time to accuracy", lambda ctx: fake_figures()[1]))
    args = ["--only", "accuracy", "--output-dir", str(tmp_path)] + (["--quick"] if quick else [])
    assert bench_run.main(args) == 0
    _, figures = read_json(tmp_path / "results.json")
    expected = {"scaling", "accuracy", "launch"} if quick else {"accuracy"}
    assert {figure.key for figure in figures} == expected


def test_the_full_gpu_figures_refuse_a_machine_without_cuda_in_one_line(capsys):
    from bench import gpu as bench_gpu

    if torch.cuda.is_available():
        unavailable("this machine has CUDA, where the full GPU figures would run: the refusal needs a machine without")
    assert bench_gpu.main(["--only", "gpu-loop"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "no CUDA device" in error and "--quick" in error


def test_the_gpu_memory_row_pairs_rounds_and_says_why_it_is_empty():
    from bench.harness.gpu import memory_row

    row = memory_row("a / b", {"a": [2.0, 3.3], "b": [1.0, 3.0]}, Goal("<=", 1.05))
    assert row.ratio == pytest.approx(1.55) and row.spread == pytest.approx((1.1, 2.0)) and row.met is False
    assert "a 2.65 GiB, b 2.00 GiB" in row.notes
    empty = memory_row("a / b", {"a": [None], "b": [1.0]})
    assert empty.ratio is None and "no CUDA device" in empty.notes


def test_a_profile_is_summarised_from_a_real_trace_and_an_allocator_history(tmp_path):
    """The trace is torch.profiler's own (CPU ops here, one step range); the history is in the format torch's
    _dump_snapshot writes (torch/cuda/memory.py documents it), which a CPU cannot produce."""
    import pickle

    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.harness.profile_summary import memory_summary, profile_summary

    folder = tmp_path / "profiles"
    folder.mkdir()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        for step in (2, 3):
            with record_function(f"ProfilerStep#{step}"), record_function("FSDP::pre_forward"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    profiled.export_chrome_trace(str(folder / "rank-0.pt.trace.json"))
    trace = profile_summary(tmp_path)["trace"]
    assert trace["steps"] == 2 and len(trace["step_ms"]) == 2 and trace["kernel_ms_per_step"] == 0
    assert set(trace["fsdp_host_ms_per_step"]) == {"FSDP::pre_forward"}

    def frame(filename: str, name: str) -> dict:
        return {"filename": filename, "line": 7, "name": name}

    fsdp = [frame("/x/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "alloc_all_gather_outputs"),
            frame("/x/trainer/loop.py", "train")]
    ours = [frame("??", "c10::alloc"), frame("/x/trainer/sharding.py", "forward"), frame("/y/model.py", "forward")]
    events = [{"action": "alloc", "addr": 1, "size": 3 * 2**30, "frames": fsdp},
              {"action": "alloc", "addr": 2, "size": 2**30, "frames": ours},
              {"action": "free_requested", "addr": 1, "size": 3 * 2**30, "frames": []},
              {"action": "free_completed", "addr": 1, "size": 3 * 2**30, "frames": []},
              {"action": "alloc", "addr": 3, "size": 2 * 2**30, "frames": [frame("/y/model.py", "forward")]},
              {"action": "free_completed", "addr": 99, "size": 5 * 2**30, "frames": []}]  # allocated before
    snapshot = {"segments": [{"blocks": [{"size": 2**30, "state": "active_allocated"},
                                         {"size": 2**29, "state": "inactive"}]}], "device_traces": [events]}
    (folder / "rank-0.memory.pickle").write_bytes(pickle.dumps(snapshot))
    memory = memory_summary(folder / "rank-0.memory.pickle")
    assert memory["peak_above_start_gib"] == 4.0 and memory["active_at_dump_gib"] == 1.0
    assert memory["at_peak_by_site_gib"] == {
        "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:7 alloc_all_gather_outputs": 3.0,
        "trainer/sharding.py:7 forward": 1.0}
    assert "memory" in profile_summary(tmp_path)
