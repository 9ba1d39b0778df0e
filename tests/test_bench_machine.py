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
    with pytest.raises(AssertionError, match="built or tuned"):
        bench.machine_info()  # the default asks the kernels for their tuning
