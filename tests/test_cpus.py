import os

import pytest
import torch

from pagedserve.common import cpus
from pagedserve.executor_svc.device import cap_cpu_threads


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """Points the quota files at tmp_path; returns a writer of cgroup v2's cpu.max."""
    monkeypatch.setattr(cpus, "CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(cpus, "CFS_QUOTA", tmp_path / "cfs_quota_us")
    monkeypatch.setattr(cpus, "CFS_PERIOD", tmp_path / "cfs_period_us")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    return lambda text: (tmp_path / "cpu.max").write_text(text)


@pytest.mark.parametrize("cpu_max, expected", [("max 100000\n", 64), ("200000 100000\n", 2),
                                               ("150000 100000\n", 2), ("5000 100000\n", 1),
                                               ("9000000 100000\n", 64)])
def test_a_cgroup_v2_quota_caps_the_affinity_mask(cgroup, cpu_max, expected):
    cgroup(cpu_max)
    assert cpus.usable_cpus() == expected


def test_a_cgroup_v1_quota_counts_where_v2_has_none(cgroup, tmp_path):
    (tmp_path / "cfs_quota_us").write_text("300000\n")
    (tmp_path / "cfs_period_us").write_text("100000\n")
    assert cpus.usable_cpus() == 3
    (tmp_path / "cfs_quota_us").write_text("-1\n")
    assert cpus.usable_cpus() == 64


def test_no_cgroup_files_leave_the_affinity_mask(cgroup):
    assert cpus.usable_cpus() == 64


def test_torch_threads_shrink_to_the_quota_unless_omp_num_threads_is_set(cgroup, monkeypatch):
    threads = torch.get_num_threads()
    cgroup("100000 100000\n")
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        cap_cpu_threads()
        assert torch.get_num_threads() == threads
        monkeypatch.delenv("OMP_NUM_THREADS")
        cap_cpu_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
