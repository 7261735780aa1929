"""Start a group of ringcomm workers on this host (torchrun-compatible).

The parts: :mod:`.config` (the command line and each worker's environment),
:mod:`.workers` (starting, watching, blaming, stopping and restarting the workers),
:mod:`.processes` (one worker's processes: its session, output relay and signals) and
:mod:`.rounds` (how the launchers of several hosts agree on each restart).

Usage::

    python -m ringcomm.launch [options] [script.py args... | -m module args...]

With neither a script nor ``-m``, the project's main job ``-m ringcomm.train --main-job``
(``DEFAULT_MODULE``, ``DEFAULT_ARGS``: ZeRO-2 fp16 training) is run.  Everything after the script path or the module
name is handed to every worker unchanged, so ``train.py --lr 0.1`` reaches the
worker as ``sys.argv[1:] == ["--lr", "0.1"]``.

Options (dash and underscore spellings are both accepted):

  --nproc N             workers on this host (alias --nproc-per-node), default 1
  --nnodes N            hosts in the job, default 1
  --node-rank R         index of this host, default 0
  --master-addr HOST    rank 0's host; default $MASTER_ADDR or 127.0.0.1
  --master-port PORT    default $MASTER_PORT; with one node a free TCP port is
                        picked (again for each restart); with several, 29500
  --max-restarts K      on a failure stop all workers and start them all again,
                        at most K times, default 0; with several nodes every node's
                        launcher does, in step (see .rounds; the workers then meet on
                        MASTER_PORT + 1)
  --timeout SECONDS     collective deadline, exported as RINGCOMM_TIMEOUT
  --device KIND         auto | cpu | gpu, exported as RINGCOMM_DEVICE
  --on-failure POLICY   stop (default): a failure stops every worker, as below;
                        continue: it is reported and the others go on (they shrink
                        their communicators: ringcomm.elastic), exported as
                        RINGCOMM_ON_FAILURE; with --max-restarts (one node) a job
                        that fails as a whole is restarted
  --no-prefix           let workers write straight to the launcher's terminal

Environment of each worker (on top of the launcher's own):

  RANK = node_rank * nproc + local_rank, LOCAL_RANK, WORLD_SIZE = nnodes * nproc,
  LOCAL_WORLD_SIZE = nproc, GROUP_RANK = node_rank, MASTER_ADDR, MASTER_PORT,
  TORCHELASTIC_RESTART_COUNT and RINGCOMM_RESTART_COUNT (attempt number, from 0),
  PYTHONUNBUFFERED=1, OMP_NUM_THREADS=1 (only if nproc > 1 and it is not set),
  RINGCOMM_TIMEOUT (only with --timeout), RINGCOMM_DEVICE (only with --device),
  RINGCOMM_JOB_ID (from the launcher's environment, else random on one node), and
  RINGCOMM_SECRET: from the launcher's RINGCOMM_SECRET or RINGCOMM_SECRET_FILE, else random
  on one node; with several nodes one of them is required (RINGCOMM_INSECURE=1 accepts a
  secret derived from the master address and port, with a warning).

Workers run as ``sys.executable -u ...``, each in its own session/process group. On Linux
each is killed by the kernel (SIGKILL) when the launcher dies, however it dies: workers never
outlive their launcher.
Their stdout and stderr lines are re-emitted as ``[rank R]: line`` on the
launcher's stdout and stderr respectively.

Failure behaviour: as soon as one worker exits non-zero or dies by a signal, the
launcher waits up to 1.5 s for the others' reports, then says on stderr what ended each
failed rank (``ringcomm.launch: rank 2 (local rank 2, pid 1234) failed: exit code 3:
ValueError: ...``; each worker writes its uncaught exception to ``RINGCOMM_ERROR_FILE``).
When failed ranks blame another one (a ``CommTimeout`` after a liveness check, a
``PeerLost``), they are reported as its victims and it is named: ``rank 1 stopped answering
its peers (named by rank(s) 0, 2); it is still running, stopped or hung: killing it now``. Then the launcher
sends SIGTERM to every worker's process group, waits 3 s, SIGKILLs whatever is left and
reaps all workers.  It then restarts
the group if restarts remain.  Exit status: 0 if every worker exited 0, 1 after
a failure, 130 on SIGINT and 143 on SIGTERM (forwarded to workers as SIGTERM).

With ``--on-failure continue`` a failed worker is reported as it ends (``ringcomm.launch:
rank 2 (local rank 2, pid 1234) was lost: killed by signal 9 (SIGKILL); 3 rank(s) here go
on``) and nothing is stopped; the job ends when every worker has ended, with status 0 if
some exited 0 and every other one was lost to a signal (a crash counts as one), else 1; a
status 1 restarts every worker while ``--max-restarts`` allows (one node: the survivors'
fallback, ``--resume`` from the last checkpoint, when memory no longer holds the state).
With several nodes each node's launcher decides its own status from its own workers.

Examples::

    python -m ringcomm.launch --nproc 4                    # the main job (ZeRO-2 training)
    python -m ringcomm.launch --nproc 4 -m ringcomm.selfcheck   # check every collective
    python -m ringcomm.launch --nproc 2 train.py --lr 0.1
    RINGCOMM_SECRET=... python -m ringcomm.launch --nnodes 2 --node-rank 0 \\
        --nproc 8 --master-addr 10.0.0.1 --master-port 29500 -m mypkg.train
"""
