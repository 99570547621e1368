"""How many CPUs this process may use: what thread pools on the host should be sized to."""
import math
import os
from pathlib import Path

# cgroup v2's quota file ("max 100000" or "200000 100000": quota and period in us), and v1's two.
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CFS_QUOTA, CFS_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _quota() -> float | None:
    """The cgroup's CPU quota in CPUs, None when unlimited or unknown."""
    try:
        quota, period = CPU_MAX.read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = CFS_QUOTA.read_text().strip(), CFS_PERIOD.read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def usable_cpus() -> int:
    """The CPUs of this process's affinity mask, capped by its cgroup's CPU quota (`docker run
    --cpus 2`, a Kubernetes CPU limit), which affinity does not show: OpenMP, and so torch, size
    their thread teams by affinity alone, and a team larger than the quota spins at barriers
    against itself."""
    cpus = len(os.sched_getaffinity(0))
    quota = _quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))
