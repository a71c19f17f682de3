"""benchmarks/bench_gpu.py on the CPU at tiny sizes: its FLOP counting, its MFU arithmetic, its
device-peak table and one end-to-end run, so the GPU benchmark keeps working without a GPU."""

import pytest
import torch

from benchmarks import bench_gpu


def tiny_clip(tmp_path, *arguments: str) -> dict:
    """The one row of a tiny CPU run of clip with these extra command-line arguments."""
    (row,) = bench_gpu.main(
        [
            "--tiny",
            "--methods",
            "clip",
            "--work",
            str(tmp_path),
            *arguments,
            "trainer.progress_refresh_rate=0",
        ]
    )
    return row


def test_counted_flops_of_a_linear_layer_are_two_times_in_times_out_times_batch():
    layer = torch.nn.Linear(12, 5, bias=False)
    inputs = torch.randn(7, 12)
    assert bench_gpu.counted_flops(lambda: layer(inputs)) == 2 * 12 * 5 * 7


def test_counted_flops_of_a_training_step_add_the_weight_gradient_of_the_backward_pass():
    layer = torch.nn.Linear(12, 5, bias=False)
    inputs = torch.randn(7, 12)  # no input gradient: the backward computes the weight's only
    assert bench_gpu.counted_flops(lambda: layer(inputs).sum().backward()) == 2 * (2 * 12 * 5 * 7)


def test_mfu_is_achieved_flops_per_second_over_the_peak():
    assert bench_gpu.mfu(flops_per_step=3e12, seconds_per_step=0.5, peak=100.0) == pytest.approx(
        0.06
    )


def test_device_peak_is_looked_up_by_name_most_specific_first_and_can_be_overridden():
    assert bench_gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench_gpu.peak_tflops("NVIDIA H200") == 989.4
    assert bench_gpu.peak_tflops("NVIDIA H200", override=500.0) == 500.0
    assert bench_gpu.peak_tflops("cpu") is None


def test_paper_model_refuses_a_method_it_has_no_paper_size_for():
    from benchmarks.paper_models import paper_method

    with pytest.raises(ValueError, match="no paper-size model for 'mclip'"):
        paper_method("mclip", None, None)


def test_tiny_cpu_run_reports_three_loops_whose_mfu_and_ratios_follow_from_its_own_numbers(
    tmp_path,
):
    rows = bench_gpu.main(
        [
            "--tiny",
            "--methods",
            "clip",
            "--peak-tflops",
            "0.5",
            "--work",
            str(tmp_path),
            "--json",
            str(tmp_path / "bench.json"),
            "--jpeg",
            "40x30",
            "trainer.progress_refresh_rate=0",
        ]
    )
    (row,) = rows
    assert row["method"] == "clip" and row["batch"] == 4
    flops_per_step = row["gflops_per_sample"] * 1e9 * row["batch"]
    for loop in bench_gpu.LOOPS:
        t = row[loop]
        assert t["samples_per_s"] == pytest.approx(row["batch"] / t["s_per_step"])
        assert t["mfu"] == pytest.approx(
            flops_per_step * t["samples_per_s"] / row["batch"] / 0.5e12
        )
    assert row["loader/bare"] == pytest.approx(
        row["loader"]["samples_per_s"] / row["bare"]["samples_per_s"]
    )
    assert row["lightning/bare"] == pytest.approx(
        row["lightning"]["samples_per_s"] / row["bare"]["samples_per_s"]
    )
    assert (tmp_path / "bench.json").exists()


def test_world_images_become_jpeg_photos_of_the_asked_size_once(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "a.png")
    bench_gpu.as_jpeg_photos(tmp_path, "20x15")
    with Image.open(tmp_path / "a.png") as image:
        assert (image.format, image.size) == ("JPEG", (20, 15))
    (tmp_path / "a.png").write_bytes(b"changed")
    bench_gpu.as_jpeg_photos(tmp_path, "20x15")  # the marker: not re-encoded
    assert (tmp_path / "a.png").read_bytes() == b"changed"


def test_profile_reports_per_step_numbers_it_also_writes_beside_the_operator_tables(tmp_path):
    import json

    row = tiny_clip(tmp_path, "--profile", str(tmp_path / "prof"), "--profile-steps", "2")
    summary = row["profile"]
    text = (tmp_path / "prof" / "clip.txt").read_text()  # its folder is made as needed
    assert json.loads(text[: text.index("\n\n")]) == summary
    assert "# by host time" in text and "aten::" in text
    assert summary["steps"] == 2 and summary["wall_ms_per_step"] > 0
    # the CPU has no kernels: no device share is claimed
    assert summary["device_busy"] is None and summary["kernels_per_step"] == 0


def test_profile_splits_the_step_into_its_phases_and_the_forward_into_the_modules_parts(tmp_path):
    row = tiny_clip(tmp_path, "--profile", str(tmp_path / "prof"), "--profile-steps", "2")
    parts = row["profile"]["parts_ms_per_step"]
    assert {"step:forward", "step:backward", "step:optimizer"} <= set(parts)
    # clip's direct children each ran inside the forward, whose host time holds theirs
    assert {"part:image_encoder", "part:text_encoder"} <= set(parts)
    inner = parts["part:image_encoder"]["host_ms"] + parts["part:text_encoder"]["host_ms"]
    assert 0 < inner <= parts["step:forward"]["host_ms"]


def test_profile_summary_counts_kernels_not_the_ranges_that_span_them():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, *, annotation=False, self_device=0.0, cpu=0.0, count=1):
        return SimpleNamespace(
            key=key,
            device_type=device_type,
            is_user_annotation=annotation,
            self_device_time_total=self_device,
            cpu_time_total=cpu,
            count=count,
        )

    averages = [
        event("step:forward", DeviceType.CPU, annotation=True, cpu=6000.0),
        # the same range on the device timeline: a 9 ms span around 4 ms of kernels
        event("step:forward", DeviceType.CUDA, annotation=True, self_device=9000.0),
        event("Optimizer.step#AdamW.step", DeviceType.CUDA, annotation=True, self_device=5000.0),
        event("gemm_kernel", DeviceType.CUDA, self_device=3000.0, count=30),
        event("elementwise_kernel", DeviceType.CUDA, self_device=1000.0, count=10),
        event("cudaDeviceSynchronize", DeviceType.CPU, cpu=10.0, count=2),
    ]
    summary = bench_gpu.profile_summary(averages, steps=2, wall=0.010)
    assert summary["device_ms_per_step"] == 2.0  # 4 ms of kernels over 2 steps
    assert summary["kernels_per_step"] == 20 and summary["mean_kernel_us"] == 100.0
    assert summary["device_busy"] == pytest.approx(0.4)
    assert summary["syncs_per_step"] == 1
    assert summary["parts_ms_per_step"] == {"step:forward": {"host_ms": 3.0, "device_span_ms": 4.5}}


def test_part_ranges_leave_no_hook_behind():
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with bench_gpu.PartRanges(module):
        module(torch.randn(2, 3))
    assert not any(child._forward_hooks or child._forward_pre_hooks for child in module)


def test_loops_times_only_the_named_loops_and_gives_only_the_ratios_it_can(tmp_path):
    row = tiny_clip(tmp_path, "--loops", "bare,loader")
    assert "bare" in row and "loader" in row and "lightning" not in row
    ratios = sorted(key for key in row if "/" in key)
    assert ratios == ["loader/bare"]


def test_loops_refuses_a_loop_it_does_not_know(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--loops", "bare,warp"])
    assert "--loops: unknown ['warp']" in capsys.readouterr().err


def test_a_slow_first_batch_counts_as_startup_not_as_timed_steps(tmp_path, monkeypatch):
    import time

    def late_first_batch(self):  # the pre-loaded batches, the first one 0.5 s late
        for index in range(self.count):
            if index == 0:
                time.sleep(0.5)
            yield self.batches[index % len(self.batches)]

    monkeypatch.setattr(bench_gpu.Repeat, "__iter__", late_first_batch)
    row = tiny_clip(tmp_path, "--loops", "bare,lightning")
    assert "startup_s" not in row["bare"]  # its batches are already in hand
    assert row["lightning"]["startup_s"] >= 0.5
    assert row["lightning"]["s_per_step"] * 2 < 0.5  # two timed tiny steps, without the wait


def test_loader_warms_up_one_batch_per_worker_and_flags_an_epoch_boundary_in_its_window(
    tmp_path, capsys
):
    # 16 images at batch 4: 4 batches an epoch; 2 workers make the warm-up 2, and 2 + 3 steps > 4
    row = tiny_clip(tmp_path, "--loops", "loader", "--steps", "3", "data.num_workers=2")
    assert row["loader"]["warmup"] == 2
    assert row["loader"]["epoch_boundary_in_window"] is True
    assert "clip loader: an epoch boundary falls inside the timed window" in capsys.readouterr().out
    row = tiny_clip(tmp_path, "--loops", "loader", "--steps", "2", "data.num_workers=0")
    assert row["loader"]["warmup"] == 1 and row["loader"]["epoch_boundary_in_window"] is False
