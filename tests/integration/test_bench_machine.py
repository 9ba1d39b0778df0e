"""``machine_info``: what every benchmark's JSON records about the machine."""
import pytest

from codraft import bench
from codraft.kernels import gemv


def test_machine_info_records_the_kernels_tuning_only_for_benches_that_decode(monkeypatch):
    def must_not_build():
        raise AssertionError("machine_info(kernels=False) built or tuned the decode kernels")

    monkeypatch.setattr(gemv, "kernel", must_not_build)
    info = bench.machine_info(kernels=False)
    assert "gemv_tuning" not in info
    assert info["cpu_count"] >= 1 and info["processor"] and info["torch"]
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()  # (the first CPU's)
    assert info["cpu_flags"] == {f: f in flags for f in bench.CPU_FLAGS} and info["cpu_flags"]["avx2"]
    with pytest.raises(AssertionError, match="built or tuned"):
        bench.machine_info()  # the default asks the kernels for their tuning


def test_the_cpu_meter_tells_the_hypervisors_steal_apart_from_other_processes(monkeypatch):
    """/proc/stat's first line: user nice system idle iowait irq softirq steal. Over 2 s of wall
    clock, the machine's user time grows by 2 s (1 s of it this process's) and steal by 1 s: one
    core's half busy with another process, half a core stolen. Without /proc: neither is claimed."""
    import builtins
    import io
    import os
    import time
    real_open = builtins.open
    hz = os.sysconf("SC_CLK_TCK")
    now = {"stat": "cpu  100 0 50 1000 0 0 0 10 0 0\n", "wall": 10.0, "own": 3.0}
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(now["stat"]) if path == "/proc/stat"
                        else real_open(path, *a, **k))
    monkeypatch.setattr(time, "perf_counter", lambda: now["wall"])
    monkeypatch.setattr(time, "process_time", lambda: now["own"])
    meter = bench.CpuMeter()
    now.update(stat=f"cpu  {100 + 2 * hz} 0 50 {1000 + 3 * hz} 0 0 0 {10 + hz} 0 0\n", wall=12.0, own=4.0)
    load = meter.read()
    assert load["wall_s"] == 2.0 and load["own_cpu_s"] == 1.0
    assert load["others_cores"] == pytest.approx(0.5) and load["stolen_cores"] == pytest.approx(0.5)
    now["stat"] = "no cpu line\n"  # unreadable: as on a machine without /proc
    assert not {"others_cores", "stolen_cores"} & set(bench.CpuMeter().read())
