import os

import pytest

from pagedserve.common import cpus


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
