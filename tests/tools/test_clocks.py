"""tools/clocks.py: the clock sampler runs nvidia-smi with the query it means, reads its samples back (skipping
the ones it could not read) and summarizes them; without nvidia-smi or a CUDA device it is a no-op. nvidia-smi is
a stand-in script here (no GPU on the CPU machines)."""

import os
import stat
import time

import pytest
import torch

import clocks


def _fake_nvidia_smi(folder, lines: list[str]) -> str:
    """A script named nvidia-smi that writes its arguments to args.txt, prints ``lines`` and waits to be
    stopped (as nvidia-smi -lms does)."""
    script = folder / "nvidia-smi"
    body = "".join(f"echo '{line}'\n" for line in lines)
    script.write_text(f"#!/bin/sh\necho \"$@\" > {folder / 'args.txt'}\n{body}exec sleep 30\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(folder)


def test_samples_summarized(tmp_path, monkeypatch):
    folder = _fake_nvidia_smi(tmp_path, ["1485, 675.50", "[N/A], 690.00", "1515, 690.50", "garbage", "1395, 702.25"])
    monkeypatch.setenv("PATH", folder + os.pathsep + os.environ["PATH"])
    sampler = clocks.ClockSampler(torch.device("cpu"), interval_ms=50)
    sampler.selector = "GPU-1234"  # what device_selector gives a CUDA device
    start = time.monotonic()
    with sampler:
        for _ in range(100):  # until the script has printed (it starts in a few ms)
            if (tmp_path / "args.txt").exists():
                break
            time.sleep(0.05)
        time.sleep(0.2)
    assert time.monotonic() - start < 15  # stopped at the block's end, not after the script's 30 s
    assert (tmp_path / "args.txt").read_text().split() == [
        "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50", "-i", "GPU-1234"]
    summary = sampler.summary()
    assert summary == {"sm_clock_mhz": pytest.approx((1485 + 1515 + 1395) / 3), "sm_clock_min_mhz": 1395.0,
                       "power_w": pytest.approx((675.5 + 690.5 + 702.25) / 3), "power_max_w": 702.25,
                       "clock_samples": 3}
    assert set(summary) == set(clocks.FIELDS)


def test_no_op_without_a_gpu_or_nvidia_smi(tmp_path, monkeypatch):
    # The CPU: no selector, nothing run, the summary's values None.
    with clocks.ClockSampler(torch.device("cpu")) as sampler:
        pass
    assert sampler.command() is None
    assert sampler.summary() == {"sm_clock_mhz": None, "sm_clock_min_mhz": None, "power_w": None,
                                 "power_max_w": None, "clock_samples": 0}
    # A CUDA device but no nvidia-smi on PATH.
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = clocks.ClockSampler(torch.device("cpu"))
    sampler.selector = "GPU-1234"
    assert sampler.command() is None
    # nvidia-smi on PATH but not runnable: the block still runs, no samples.
    (tmp_path / "nvidia-smi").write_text("not a program")
    (tmp_path / "nvidia-smi").chmod(0o755)
    with sampler:
        pass
    assert sampler.summary()["clock_samples"] == 0
    with pytest.raises(ValueError, match="interval_ms=0"):
        clocks.ClockSampler(torch.device("cpu"), interval_ms=0)


def test_device_selector_names_the_card_by_uuid(monkeypatch):
    """nvidia-smi's -i for a CUDA device is "GPU-" and the UUID torch reports (nvidia-smi -L's form), whatever
    form torch gives it in; None off CUDA or where torch reports none."""
    import types

    uuids = {0: "5fbd5d9d-1b2c-3d4e-5f60-718293a4b5c6", 1: "GPU-0a1b2c3d-0000-1111-2222-333344445555", 2: None}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=uuids[device.index]))
    assert clocks.device_selector(torch.device("cuda", 0)) == "GPU-5fbd5d9d-1b2c-3d4e-5f60-718293a4b5c6"
    assert clocks.device_selector(torch.device("cuda", 1)) == "GPU-0a1b2c3d-0000-1111-2222-333344445555"
    assert clocks.device_selector(torch.device("cuda", 2)) is None
    assert clocks.device_selector(torch.device("cpu")) is None


def test_dmon_windows_session57():
    """Session 57's call 1 (an H100 at its 700 W cap): the figures docs/performance.md quotes, from its own files."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench", "session57", "call1")
    with open(os.path.join(root, "dmon.txt")) as f_dmon, open(os.path.join(root, "marks.txt")) as f_marks:
        dmon, marks = f_dmon.read(), f_marks.read()
    windows = dict(clocks.dmon_windows(dmon, marks, load_w=400))  # the floor session 57 counted from
    assert list(windows) == ["ours", "torchtitan"]
    assert windows["ours"]["clock_samples"] == 10 and round(windows["ours"]["sm_clock_mhz"]) == 1491
    assert round(windows["torchtitan"]["sm_clock_mhz"]) == 1518 and windows["torchtitan"]["power_max_w"] == 697
    steady = dict(clocks.dmon_windows(dmon, marks))  # the default floor drops ours' one 530 W second
    assert steady["ours"]["clock_samples"] == 9 and round(steady["ours"]["sm_clock_mhz"]) == 1488


def test_dmon_windows_by_hand(capsys):
    dmon = """#Time         gpu    pwr  gtemp  mtemp   mclk   pclk
#HH:MM:SS     Idx      W      C      C    MHz    MHz
 10:00:00       0    120     38     43   2619   1980
 10:00:01       0    650     50     50   2619   1500
 10:00:02       0      -     50     50   2619   1400
#Time         gpu    pwr  gtemp  mtemp   mclk   pclk
 10:00:03       0    700     50     50   2619   1300
 10:00:04       0    690     50     50   2619   1600
 10:00:05       0    100     50     50   2619   1980
"""
    marks = "a 10:00:00\nb 10:00:04\nc 10:00:05\nend 10:00:06\n"
    windows = dict(clocks.dmon_windows(dmon, marks))
    # a: 10:00:00-03 under load at >= 650 W, the unreadable second dropped: 1500 and 1300 MHz
    assert windows["a"] == {"sm_clock_mhz": 1400.0, "sm_clock_min_mhz": 1300.0, "power_w": 675.0,
                            "power_max_w": 700.0, "clock_samples": 2}
    assert windows["b"]["clock_samples"] == 1 and windows["b"]["sm_clock_mhz"] == 1600.0
    assert windows["c"]["clock_samples"] == 0 and windows["c"]["sm_clock_mhz"] is None
    assert dict(clocks.dmon_windows(dmon, marks, load_w=50))["c"]["clock_samples"] == 1


def test_dmon_window_across_midnight_reads_nothing():
    dmon = "#Time gpu pwr pclk\n 23:59:59 0 690 1400\n 00:00:01 0 690 1500\n"
    (name, summary), = clocks.dmon_windows(dmon, "a 23:59:59\nend 00:00:02\n", load_w=0)
    assert name == "a" and summary["clock_samples"] == 0 and summary["sm_clock_mhz"] is None
