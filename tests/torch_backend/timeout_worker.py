"""init_process_group(timeout=3 s) bounds a collective's wait: rank 1 stays away, rank 0's
barrier raises within the timeout (run under a launcher; writes OUT_DIR/rank{r}.json)."""
import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import ringcomm.torch  # noqa: F401 - registers the backend

dist.init_process_group("ringcomm", timeout=timedelta(seconds=3))
rank = dist.get_rank()
report = {}
if rank == 0:
    start = time.monotonic()
    try:
        dist.barrier()
        report["error"] = None
    except Exception as exc:  # noqa: BLE001 - what the test checks
        report["error"], report["words"] = type(exc).__name__, str(exc)
    report["seconds"] = time.monotonic() - start
else:
    time.sleep(8)  # never calls the barrier
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
os._exit(0)  # the world is broken by design: no goodbye
