"""``python -m ringcomm.train`` whose rank 1 SIGKILLs itself as step ``KILL_AT_STEP`` begins
(counting from 0, so after that many steps), in a launcher's first attempt only: the fault
that --max-restarts and --resume must recover from."""
import os
import signal
import sys

from ringcomm.train import cli, trainer

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    kill_at, batch = int(os.environ["KILL_AT_STEP"]), trainer.Job.batch

    def batch_or_die(job, step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return batch(job, step)
    trainer.Job.batch = batch_or_die

sys.exit(cli.main(sys.argv[1:]))
