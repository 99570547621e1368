"""A tensor-parallel rank other than 0: `python -m pagedserve.executor_svc.tp_worker SPEC`, started
by rank 0 (tp_workers.start_workers) with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and
LOCAL_RANK set. It builds the same Worker as rank 0 (on cuda:LOCAL_RANK on GPUs) and repeats
rank 0's worker calls on it until rank 0 stops it or dies."""
import json
import os
import sys

from pagedserve.common.config import EngineConfig
from pagedserve.common.log import configure, get_logger
from pagedserve.common.process import die_with
from pagedserve.executor_svc.worker import Worker

log = get_logger(__name__)


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    configure(spec["log"]["level"], service=f"executor-rank{rank}", fmt=spec["log"]["fmt"])
    # Asked here, not in a Popen preexec_fn, which would make subprocess fork (see
    # common/process.die_with_launcher).
    if not die_with(spec["parent"]):
        # Rank 0 died before this process asked to die with it.
        return 1
    try:
        worker = Worker(EngineConfig(**spec["config"]), spec["offline"], rank=rank)
    except Exception as e:  # noqa: BLE001 - rank 0 reports the rank's exit; this says why
        sys.stderr.write(f"pagedserve: error: tensor-parallel rank {rank}: {e}\n")
        return 1
    repeat_calls(worker)
    return 0


def repeat_calls(worker: Worker) -> None:
    while True:
        for method, args in worker.tp.receive():
            try:
                if method == "collect":
                    worker.collect(worker.runner.launched[0])
                else:
                    getattr(worker, method)(*args)
            except Exception as e:  # noqa: BLE001 - rank 0 failed the same call and reports it
                log.debug("tp_call_failed", method=method, error=str(e))


if __name__ == "__main__":
    sys.exit(main())
